"""Step time of trl_stable.GRPOTrainer against trl.GRPOTrainer, side by side on the tiny kit.

Variants: TRL itself, trl_stable with every option at its default (goal: ratio <= 1.02), and trl_stable with the
decoupled loss + NGRPO + IcePop or KPop (the proximal-log-prob recompute is the one extra forward it may add, plus
the sampler log-prob recording during generation). Rounds interleave the variants so machine noise hits them alike.
Two ratios are printed per variant, both of medians over the timed steps: wall-clock seconds per step, and the
process CPU seconds per step (with one torch thread, CPU time counts the work itself and is far less disturbed by
other jobs on a shared machine than wall-clock time).

    python benchmarks/bench_grpo_step.py                      # ~1-2 minutes on CPU
    python benchmarks/bench_grpo_step.py --rounds 5 --steps 8 --family llama --max-completion-length 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from exp_common import PROMPTS  # noqa: E402  (the method experiments' prompts)
from tqdm import tqdm  # noqa: E402
from transformers import PrinterCallback, TrainerCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import trl_stable  # noqa: E402
from trl_stable.testing import build_causal_lm, build_tokenizer  # noqa: E402

STABLE_ON = {"use_decoupled_loss": True, "advantage_estimator": "ngrpo"}
VARIANTS = {
    "trl": (trl.GRPOTrainer, trl.GRPOConfig, {}),
    "trl_stable defaults": (trl_stable.GRPOTrainer, trl_stable.GRPOConfig, {}),
    "decoupled+ngrpo+icepop": (trl_stable.GRPOTrainer, trl_stable.GRPOConfig, {**STABLE_ON, "token_filter": "icepop"}),
    "decoupled+ngrpo+kpop": (trl_stable.GRPOTrainer, trl_stable.GRPOConfig, {**STABLE_ON, "token_filter": "kpop"}),
}


def vowel_share_reward(completions, **kwargs):
    """In [0, 1] and varied within groups, so every variant computes real advantages and gradients."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


class StepTimer(TrainerCallback):
    """(wall, process CPU) seconds of every optimizer step: generation, scoring, loss and backward."""

    def __init__(self):
        self.steps: list[tuple[float, float]] = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append((time.perf_counter() - self._start[0], time.process_time() - self._start[1]))


def run_variant(name, tokenizer, args_ns, out_dir) -> list[tuple[float, float]]:
    trainer_cls, config_cls, extra = VARIANTS[name]
    args = config_cls(
        output_dir=out_dir,
        per_device_train_batch_size=args_ns.batch_size,
        num_generations=args_ns.num_generations,
        max_completion_length=args_ns.max_completion_length,
        max_steps=args_ns.steps + 1,
        learning_rate=1e-4,
        logging_steps=1,
        seed=0,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        **extra,
    )
    trainer = trainer_cls(
        model=build_causal_lm(args_ns.family, tokenizer, seed=0),
        reward_funcs=vowel_share_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * (args_ns.steps + 2)}),
        processing_class=tokenizer,
    )
    trainer.remove_callback(PrinterCallback)  # disable_tqdm swaps the progress bar for a printer of every log
    timer = StepTimer()
    trainer.add_callback(timer)
    trainer.train()
    return timer.steps[1:]  # the first step is warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round (after one warm-up step)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args_ns = parser.parse_args()

    torch.set_num_threads(args_ns.threads)
    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    tokenizer = build_tokenizer()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(r, name) for r in range(args_ns.rounds) for name in VARIANTS]
        for r, name in tqdm(jobs, desc="rounds x variants"):
            times[name] += run_variant(name, tokenizer, args_ns, os.path.join(tmp, f"{r}-{len(times[name])}"))

    def medians(steps):
        return statistics.median(w for w, _ in steps), statistics.median(c for _, c in steps)

    base_wall, base_cpu = medians(times["trl"])
    print(
        f"\nmodel {args_ns.family}, batch {args_ns.batch_size}, G={args_ns.num_generations}, "
        f"max_completion_length {args_ns.max_completion_length}, {args_ns.rounds} rounds x {args_ns.steps} steps"
    )
    print(f"{'variant':<26} {'wall s/step':>12} {'ratio':>7} {'CPU s/step':>11} {'ratio':>7}")
    for name, steps in times.items():
        wall, cpu = medians(steps)
        print(f"{name:<26} {wall:>12.4f} {wall / base_wall:>7.3f} {cpu:>11.4f} {cpu / base_cpu:>7.3f}")


if __name__ == "__main__":
    main()
