"""Peak memory and time of PPO's log-prob passes against TRL GRPO's, at the same shapes (issue "Scale").

Each arm runs in a fresh process (peak resident memory, `ru_maxrss`, only grows, so arms cannot share one), on a
model whose vocabulary dominates memory (tiny hidden size, a large vocabulary), and reports the growth of the peak
over the process's peak right before the pass:

- ``grpo``: TRL's `GRPOTrainer._get_per_token_logps_and_entropies` (the fused LM head, no logits), policy pass;
- ``ppo_fused``: trl_stable's PPO policy + value pass (`PPOTrainer._forward`) through the same fused head
  (``fused_lm_head=True``, the default on CUDA);
- ``ppo_logits``: the same pass through the logits of the response positions (``fused_lm_head=False``, the default
  elsewhere, and what full KL needs);
- ``*_train``: the same with gradients: forward, the sum of the log-probs, backward.

Ratios are printed side by side (goal: PPO's peak <= 1.1x GRPO's): each PPO path against GRPO, the logits path
against the fused one, and which path ``fused_lm_head=None`` takes on the device. On a GPU, ``--device cuda``
measures `torch.cuda.max_memory_allocated` instead. Run: ``python benchmarks/bench_ppo_memory.py`` (about a minute);
``--vocab 152064 --batch 8 --response 1024`` for Qwen-sized logits (needs ~20 GB of RAM for the logits arm).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

ARMS = ("grpo", "ppo_fused", "ppo_logits", "grpo_train", "ppo_fused_train", "ppo_logits_train")


def _peak_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def run_arm(arm: str, args: argparse.Namespace) -> dict:
    """One measurement, in this process: build, warm up on a small batch, then time and measure the full pass."""
    import torch
    from datasets import Dataset

    from trl_stable import GRPOConfig, GRPOTrainer, PPOTrainer
    from trl_stable.testing import build_causal_lm, build_tokenizer
    from trl_stable.trainers.ppo.ppo_config import PPOConfig

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    model = build_causal_lm(
        "qwen2",
        tokenizer,
        seed=0,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=2,
        max_position_embeddings=args.prompt + args.response + 8,
    )
    out_dir = tempfile.mkdtemp()
    use_cpu = args.device == "cpu"
    b, p, r = args.batch, args.prompt, args.response
    ids = torch.randint(5, args.vocab, (b, p + r))
    mask = torch.ones_like(ids)
    train = arm.endswith("_train")
    kind = arm.removesuffix("_train")
    if kind == "grpo":
        cfg = GRPOConfig(
            output_dir=out_dir, per_device_train_batch_size=b, num_generations=b, max_completion_length=r,
            report_to="none", use_cpu=use_cpu, beta=0.0, logging_steps=1,
        )  # fmt: skip
        trainer = GRPOTrainer(
            model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=cfg,
            train_dataset=Dataset.from_dict({"prompt": ["a"] * b}), processing_class=tokenizer,
        )  # fmt: skip
        dev = trainer.accelerator.device
        ids, mask = ids.to(dev), mask.to(dev)

        def step(rows):
            out = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids[:rows], mask[:rows], r, compute_entropy=True
            )
            if train:
                out[0].sum().backward()
    else:
        cfg = PPOConfig(
            output_dir=out_dir, batch_size=b, mini_batch_size=b, ppo_epochs=1, max_new_tokens=r, report_to="none",
            disable_tqdm=True, save_strategy="no", use_cpu=use_cpu, fused_lm_head=kind == "ppo_fused",
        )  # fmt: skip
        trainer = PPOTrainer(model, args=cfg, processing_class=tokenizer)
        dev = trainer.accelerator.device
        batch = trainer.make_batch([row[:p] for row in ids], [row[p:] for row in ids])

        def step(rows):
            scores, values = trainer._forward(trainer.model_wrapped, {k: v[:rows] for k, v in batch.items()})
            if train:
                (scores.logprobs.sum() + values.sum()).backward()

    grad = torch.enable_grad() if train else torch.no_grad()
    with grad:
        step(1)  # warm-up on one row (kernels, allocator pools), below the full pass's peak
        if args.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = _peak_bytes(args.device)
        start = time.perf_counter()
        for _ in range(args.repeats):
            step(b)
        if args.device == "cuda":
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / args.repeats
        peak = _peak_bytes(args.device)
    growth = peak if args.device == "cuda" else peak - before
    return {"arm": arm, "peak_growth_mb": growth / 2**20, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # internal: run one arm and print JSON
    args = parser.parse_args()
    if args.arm:
        print("RESULT " + json.dumps(run_arm(args.arm, args)))
        return

    logits_mb = args.batch * args.response * args.vocab * 4 / 2**20
    print(
        f"== log-prob passes, batch {args.batch} x (prompt {args.prompt} + response {args.response}), vocabulary "
        f"{args.vocab}, hidden {args.hidden} (fp32 logits of the response would be {logits_mb:.0f} MB)"
    )
    results = {}
    forwarded = sys.argv[1:]
    for arm in ARMS:
        proc = subprocess.run(
            [sys.executable, __file__, *forwarded, "--arm", arm], capture_output=True, text=True, check=False
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{arm}: failed\n{proc.stderr[-2000:]}")
            continue
        results[arm] = json.loads(line.removeprefix("RESULT "))
        res = results[arm]
        print(f"{arm:18s} peak growth {res['peak_growth_mb']:9.1f} MB   time {res['seconds'] * 1000:8.1f} ms")
    auto = "fused" if args.device == "cuda" else "logits"
    for suffix in ("", "_train"):
        g, p, pl = (results.get(k + suffix) for k in ("grpo", "ppo_fused", "ppo_logits"))
        if g and p and pl:
            floor = max(g["peak_growth_mb"], 1.0)  # a pass that grows the peak by < 1 MB: compare against 1 MB
            fused_floor = max(p["peak_growth_mb"], 1.0)
            print(
                f"RATIO{suffix or ' no-grad'}: PPO fused / GRPO peak {p['peak_growth_mb'] / floor:.2f}x, time "
                f"{p['seconds'] / g['seconds']:.2f}x; PPO logits / GRPO peak {pl['peak_growth_mb'] / floor:.2f}x, "
                f"time {pl['seconds'] / g['seconds']:.2f}x; logits / fused peak "
                f"{pl['peak_growth_mb'] / fused_floor:.2f}x, time {pl['seconds'] / p['seconds']:.2f}x"
            )
    print(f"fused_lm_head=None (the default) takes the {auto} path on {args.device}")


if __name__ == "__main__":
    main()
