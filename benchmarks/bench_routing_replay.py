"""Routing replay, side by side: token-ratio spread under router drift, and step-time overhead.

Drift: log-probs of a batch are recorded (the "old" pass, routing recorded as in R2), then every router's weights get
noise (what one optimiser step, or a sampler/trainer mismatch, does to a router), and the first update pass is run
with and without replaying the recorded experts. The token ratios r = exp(logp_new - logp_old) are compared.

Overhead: a training step (forward + backward) on the same batch with and without replay, interleaved so both see
the same machine load; the median time ratio is printed (goal <= 1.05).

    python benchmarks/bench_routing_replay.py                      # tiny defaults, a minute on CPU
    python benchmarks/bench_routing_replay.py --families qwen3_moe --hidden-size 256 --seq-len 256 --steps 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from trl_stable.moe import SUPPORTED_ROUTERS, RoutingReplay, mask_routing
from trl_stable.testing import build_causal_lm, build_tokenizer
from trl_stable.testing.kit import MOE_FAMILIES, corpus


def _batch(tokenizer, batch_size: int, seq_len: int):
    lines = [line for line in corpus().splitlines() if line.strip()]
    texts = [" ".join(lines[i : i + 4]) for i in range(batch_size)]
    return tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=seq_len)


def _logps(model, enc):
    logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, enc["input_ids"][:, 1:, None])[..., 0]


def _overrides(family: str, args) -> dict:
    if args.hidden_size is None:
        return {}
    h = args.hidden_size
    out = {"hidden_size": h, "num_hidden_layers": args.layers, "intermediate_size": 2 * h}
    if family == "deepseek_v3":
        out.update(n_routed_experts=args.experts, moe_intermediate_size=h // 2)
    elif family == "mixtral":
        out.update(num_local_experts=args.experts, intermediate_size=h)
    else:
        out.update(num_experts=args.experts, moe_intermediate_size=h // 2)
    return out


def drift(family: str, args, tokenizer) -> dict[str, float]:
    model = build_causal_lm(family, tokenizer, seed=args.seed, **_overrides(family, args)).eval()
    enc = _batch(tokenizer, args.batch_size, args.seq_len)
    real = enc["attention_mask"][:, 1:].bool()
    replay = RoutingReplay(model)
    with torch.no_grad(), replay.record():
        old = _logps(model, enc)
    routing = mask_routing(replay.export(), enc["attention_mask"])
    generator = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ in SUPPORTED_ROUTERS:
                noise = torch.randn(module.weight.shape, generator=generator)
                module.weight.add_(noise * module.weight.std() * args.drift)
        plain = _logps(model, enc)
        with replay.replay(routing):
            replayed = _logps(model, enc)
    stats = {}
    for name, new in (("plain", plain), ("replay", replayed)):
        ratio = torch.exp(new - old)[real]
        stats[f"{name}_std"] = ratio.std().item()
        stats[f"{name}_maxdev"] = (ratio - 1).abs().max().item()
    stats["agreement"] = replay.metrics().get("routing/agreement", float("nan"))
    return stats


def overhead(family: str, args, tokenizer) -> float:
    model = build_causal_lm(family, tokenizer, seed=args.seed, **_overrides(family, args)).train()
    for module in model.modules():  # jitter would make the two arms differ by more than the hooks
        if hasattr(module, "jitter_noise"):
            module.jitter_noise = 0.0
    enc = _batch(tokenizer, args.batch_size, args.seq_len)
    replay = RoutingReplay(model)
    with torch.no_grad(), replay.record():
        model(**enc)
    routing = replay.export()

    def step(with_replay: bool) -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        if with_replay:
            with replay.replay(routing):
                loss = -_logps(model, enc).mean()
        else:
            loss = -_logps(model, enc).mean()
        loss.backward()
        return time.perf_counter() - start

    for _ in range(2):  # warm-up
        step(False), step(True)
    plain, replayed = [], []
    for i in tqdm(range(args.steps), desc=f"{family} overhead", leave=False):
        order = (False, True) if i % 2 == 0 else (True, False)
        for arm in order:
            (replayed if arm else plain).append(step(arm))
    return statistics.median(replayed) / statistics.median(plain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(MOE_FAMILIES), help="comma-separated tiny-kit MoE families")
    parser.add_argument("--drift", type=float, default=1.0, help="router noise, in units of the router weights' std")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per arm")
    parser.add_argument("--hidden-size", type=int, default=None, help="scale the tiny models up (default: kit size)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = build_tokenizer()

    header = (
        f"{'family':<12} {'std r plain':>12} {'std r replay':>13} {'spread ratio':>13} {'max|r-1| plain':>15} "
        f"{'max|r-1| replay':>16} {'agreement':>10} {'step time ratio':>16}"
    )
    print(header)
    print("-" * len(header))
    for family in args.families.split(","):
        stats = drift(family, args, tokenizer)
        ratio = overhead(family, args, tokenizer)
        print(
            f"{family:<12} {stats['plain_std']:>12.3e} {stats['replay_std']:>13.3e} "
            f"{stats['replay_std'] / stats['plain_std']:>13.3f} {stats['plain_maxdev']:>15.3e} "
            f"{stats['replay_maxdev']:>16.3e} {stats['agreement']:>10.3f} {ratio:>16.3f}"
        )
    print(
        "\nspread ratio = std of token ratios with replay / without (< 1: replay removes the routing part of the "
        "drift);\nstep time ratio = median train-step time with replay / without (goal <= 1.05)."
    )


if __name__ == "__main__":
    main()
