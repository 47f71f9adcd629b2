"""Same PPO numbers before and after a refactor: eight configurations, two steps each, every logged statistic.

`--dump out.json` runs the configurations with whichever trl_stable is importable (put an older checkout first on
``PYTHONPATH`` to record its numbers) and writes every numeric statistic of every step, plus a checksum of the
trained weights. `--compare old.json new.json` prints, per configuration, how many statistics both runs logged, the
largest relative difference among them, and the statistics only one of them logged.

The configurations: plain (token rewards + score), full KL with whitened rewards, decoupled loss + IcePop on the
sampler's log-probs, score scaling + truncation bootstrap, MoE routing replay R2 and R3, GDPO through `train()` with
two reward functions, LoRA, and DeepSpeed ZeRO-2 in one CPU process (launched through accelerate).

Run: ``python benchmarks/check_ppo_numbers.py --dump new.json`` (about a minute), then ``--compare old.json new.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

STEPS = 2
_EXTRA = json.loads(os.environ.get("PPO_NUMBERS_EXTRA", "{}"))  # extra PPOConfig fields for every configuration
PROMPTS = ["The movie was", "A story about", "I think that", "Great acting and", "The plot", "Nobody"]


def _queries(tok, n):
    import torch

    return [torch.tensor(tok(PROMPTS[i % len(PROMPTS)])["input_ids"]) for i in range(n)]


def _numeric(stats):
    """The numeric statistics, without wall-clock ones (`time/...`, runtimes), which no two runs share."""
    return {
        k: float(v)
        for k, v in stats.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith("time/") and "runtime" not in k
    }


def _weights_checksum(trainer):
    import torch

    total = 0.0
    with torch.no_grad():
        for _, param in sorted(trainer.accelerator.unwrap_model(trainer.model_wrapped).named_parameters()):
            if param.requires_grad:
                total += float(param.double().abs().sum())
    return total


def _args(out, **overrides):
    from trl_stable import PPOConfig

    base = dict(
        **_EXTRA,
        output_dir=out,
        batch_size=4,
        mini_batch_size=2,
        ppo_epochs=2,
        max_new_tokens=6,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        seed=3,
    )
    base.update(overrides)
    return PPOConfig(**base)


def _step_run(out, family="gpt2", peft=False, token_rewards=True, **overrides):
    """Two `generate` + `step` iterations on fixed prompts; returns per-step stats and the weight checksum."""
    from trl_stable import PPOTrainer
    from trl_stable.testing import build_causal_lm, build_tokenizer

    tok = build_tokenizer()
    kwargs = {}
    if peft:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0)
    trainer = PPOTrainer(
        build_causal_lm(family, tok, seed=0), args=_args(out, **overrides), processing_class=tok, **kwargs
    )
    queries = _queries(tok, 4)
    steps = []
    for step in range(STEPS):
        responses = trainer.generate(queries, return_prompt=False)
        scores = [float((len(r) + step) % 3) - 1.0 for r in responses]
        rows = [[0.1 * ((t + i) % 3 - 1) for t in range(len(r))] for i, r in enumerate(responses)]
        rows = rows if token_rewards else None
        steps.append(_numeric(trainer.step(queries, responses, token_rewards=rows, scores=scores)))
        steps[-1]["_lengths"] = float(sum(len(r) for r in responses))
    return {"steps": steps, "weights": _weights_checksum(trainer)}


def _gdpo_run(out):
    from datasets import Dataset

    from trl_stable import PPOTrainer
    from trl_stable.testing import build_causal_lm, build_tokenizer

    tok = build_tokenizer()

    def length_reward(completions, **kwargs):
        return [float(len(c)) / 10 for c in completions]

    def vowel_reward(completions, **kwargs):
        return [float(sum(ch in "aeiou" for ch in c)) for c in completions]

    dataset = Dataset.from_dict({"prompt": PROMPTS * 2})
    args = _args(out, max_steps=STEPS, multi_objective_aggregation="normalize_then_sum", logging_steps=1)
    trainer = PPOTrainer(
        build_causal_lm("gpt2", tok, seed=0),
        reward_funcs=[length_reward, vowel_reward],
        args=args,
        train_dataset=dataset,
        processing_class=tok,
    )
    trainer.train()
    steps = [_numeric(entry) for entry in trainer.state.log_history if "objective/kl" in entry]
    return {"steps": steps, "weights": _weights_checksum(trainer)}


ZERO2_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 2
  offload_optimizer_device: none
  offload_param_device: none
  gradient_accumulation_steps: 1
  zero3_init_flag: false
mixed_precision: 'no'
num_machines: 1
num_processes: 1
machine_rank: 0
main_training_function: main
use_cpu: false
"""


def _zero2_run(out):
    """ZeRO-2 in one CPU process: this script again, launched through accelerate with a DeepSpeed config."""
    config = os.path.join(out, "zero2.yaml")
    with open(config, "w") as f:
        f.write(ZERO2_CONFIG)
    record = os.path.join(out, "zero2.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("ACCELERATE_USE_CPU", None)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, os.path.abspath(__file__)]
    subprocess.run([*cmd, "--zero2_child", record], env=env, check=True, capture_output=True, text=True)
    with open(record) as f:
        return json.load(f)


CONFIGS = {
    "plain": lambda out: _step_run(out),
    "full_kl_whiten": lambda out: _step_run(out, kl_penalty="full", whiten_rewards=True),
    "decoupled_icepop": lambda out: _step_run(
        out, use_decoupled_loss=True, token_filter="icepop", token_filter_lower=0.8, token_filter_upper=1.25
    ),
    "score_scaling_bootstrap": lambda out: _step_run(
        out, token_rewards=False, use_score_scaling=True, use_score_norm=True, bootstrap_truncated=True
    ),
    "routing_r2": lambda out: _step_run(out, family="qwen2_moe", routing_replay="R2"),
    "routing_r3": lambda out: _step_run(out, family="olmoe", routing_replay="R3"),
    "gdpo_train": _gdpo_run,
    "lora": lambda out: _step_run(out, peft=True),
    "zero2": _zero2_run,
}


def dump(path: str, names: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    results = {}
    for name in names:
        with tempfile.TemporaryDirectory() as out:
            results[name] = CONFIGS[name](out)
        print(f"{name}: {len(results[name]['steps'])} steps recorded", flush=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)


def _rel(a: float, b: float) -> float:
    if math.isnan(a) and math.isnan(b):
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-6)


def compare(old_path: str, new_path: str, tol: float) -> bool:
    with open(old_path) as f:
        old = json.load(f)
    with open(new_path) as f:
        new = json.load(f)
    same = True
    print(f"{'configuration':26s} {'compared':>8s} {'max rel diff':>12s}  only in one run")
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            print(f"{name:26s} only in {'new' if name in new else 'old'}")
            same = False
            continue
        worst, count, only = 0.0, 0, set()
        a_steps, b_steps = old[name]["steps"], new[name]["steps"]
        if len(a_steps) != len(b_steps):
            print(f"{name:26s} steps differ: {len(a_steps)} vs {len(b_steps)}")
            same = False
            continue
        for a, b in zip(a_steps, b_steps):
            only |= {f"-{k}" for k in set(a) - set(b)} | {f"+{k}" for k in set(b) - set(a)}
            for key in set(a) & set(b):
                worst = max(worst, _rel(a[key], b[key]))
                count += 1
        worst = max(worst, _rel(old[name]["weights"], new[name]["weights"]))
        same &= worst <= tol
        print(f"{name:26s} {count:8d} {worst:12.2e}  {' '.join(sorted(only)) or '-'}")
    print("same numbers" if same else f"DIFFERENT (tolerance {tol:g})")
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", help="run the configurations and write their statistics to this JSON file")
    parser.add_argument("--only", nargs="*", default=None, help="configurations to run (default: all)")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    parser.add_argument("--tol", type=float, default=1e-5, help="largest relative difference that counts as same")
    parser.add_argument("--zero2_child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.zero2_child:
        import torch

        torch.set_num_threads(1)
        with tempfile.TemporaryDirectory() as out:
            result = _step_run(out, early_stopping=False)
        with open(args.zero2_child, "w") as f:
            json.dump(result, f)
        sys.stdout.flush()
        os._exit(0)
    if args.dump:
        dump(args.dump, args.only or list(CONFIGS))
    if args.compare:
        sys.exit(0 if compare(*args.compare, args.tol) else 1)


if __name__ == "__main__":
    main()
