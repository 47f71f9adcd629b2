"""The end of a run side by side with its start: the summary a PPO script prints, and the sampled continuations
it shows before and after training."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch


def sample_preview(trainer, tokenizer, prompts: Sequence[str], max_new_tokens: int, seed: int = 0) -> list[str]:
    """One sampled continuation of each prompt from the trainer's current policy, for a before/after look.

    Drawn under a forked RNG with its own seed, so the run's own random stream (and a resumed run's) is untouched.
    """
    device = trainer.accelerator.device
    devices = [device.index or 0] if device.type == "cuda" else []
    queries = [torch.tensor(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    state = random.getstate()
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            responses = trainer.generate(queries, length_sampler=lambda: max_new_tokens, return_prompt=False)
    finally:
        random.setstate(state)
    return tokenizer.batch_decode(responses, skip_special_tokens=True)


def window_mean(history: Sequence[dict], key: str) -> float:
    """Mean of `key` over the rows that have a number for it (NaN when none has)."""
    values = [float(h[key]) for h in history if key in h and not math.isnan(float(h[key]))]
    return sum(values) / len(values) if values else float("nan")


def run_summary(
    history: Sequence[dict],
    prompts: Sequence[str],
    before: Sequence[str],
    after: Sequence[str],
    reward_name: str = "environment reward",
    target_kl: float | None = None,
    window: int = 20,
    before_step: int = 0,
) -> str:
    """A short side-by-side of the run's start and end: reward, intrinsic reward, KL (and, given `target_kl`, how far
    it ended from it), distinct-2 of the rollouts (means over the first and the last `window` steps) and one
    continuation per prompt before and after.

    A reward that rises while the KL runs far past its target or the rollouts lose their diversity is the policy
    exploiting the reward, not learning the task; the summary says so when it sees it (KL above twice the target,
    or distinct-2 down by more than a quarter).
    """
    window = max(1, min(window, len(history) // 2))  # a short run compares its two halves
    first, last = list(history[:window]), list(history[-window:])
    n_first, n_last = (first[-1]["step"] if first else 0), len(history)

    def row(name: str, key: str, fmt: str) -> str:
        a, b = window_mean(first, key), window_mean(last, key)
        return f"  {name:<34} {a:{fmt}} -> {b:{fmt}}"

    kl_name = "KL to the reference" + (f" (target {target_kl:g})" if target_kl else "")
    lines = [
        f"Summary: means of steps 1-{n_first} -> steps {max(1, n_last - len(last) + 1)}-{n_last}",
        row(reward_name, "env_reward", ".3f"),
        row("intrinsic reward per sample", "intrinsic_reward", ".3f"),
        row(kl_name, "kl", ".2f"),
        row("distinct-2 of the rollouts", "distinct_2", ".3f"),
    ]
    kl_end = window_mean(last, "kl")
    if target_kl and not math.isnan(kl_end):
        off = f"{kl_end - target_kl:+.2f} ({kl_end / target_kl - 1:+.0%})"
        lines.append(f"  {f'KL at the end vs its target {target_kl:g}':<34} {kl_end:.2f}, {off}")
    d2_start, d2_end = window_mean(first, "distinct_2"), window_mean(last, "distinct_2")
    warnings_ = []
    if target_kl and kl_end > 2 * target_kl:
        warnings_.append(f"the KL ends at {kl_end:.1f}, above twice its target {target_kl:g}")
    if d2_start > 0 and d2_end < 0.75 * d2_start:
        warnings_.append(f"distinct-2 fell from {d2_start:.2f} to {d2_end:.2f}")
    if warnings_:
        lines.append(
            "  Caution: " + " and ".join(warnings_) + ": the reward gain is likely the policy exploiting the reward "
            "(repetition, drift), not learning; check the samples and a held-out evaluation (eval_scripts/)."
        )
    lines.append(f"Samples (one continuation per prompt, at step {before_step} and at step {n_last}):")
    for prompt, a, b in zip(prompts, before, after):
        lines.append(f"  {prompt!r}")
        lines.append(f"    before: {' '.join(a.split())!r}")
        lines.append(f"    after:  {' '.join(b.split())!r}")
    return "\n".join(lines)
