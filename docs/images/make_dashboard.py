"""Regenerate `docs/images/dashboard.png`: a synthetic 150-step GRPO run whose faults trip the dashboard's alarms;
with `--ppo OUTPUT_DIR`, also `docs/images/dashboard_ppo.png` from a real PPO run's health file.

    python docs/images/make_dashboard.py
    python examples/research_projects/sentiment/ppo_intrinsic.py --use_intrinsic_reward   # the README's command
    python docs/images/make_dashboard.py --ppo outputs/sentiment/ppo_intrinsic

The synthetic run is deterministic (seeded); it replays the log history through the same rules as a live run.
"""

import argparse
import math
import random
from pathlib import Path

from trl_stable.monitoring import render_dashboard


def synthetic_history(n: int = 150, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    history = []
    for step in range(1, n + 1):
        history.append(
            {
                "step": step,
                "loss": rng.uniform(-0.02, 0.02),
                # learns, then stalls at 0.7 below the declared maximum 1.0 (reward_plateau)
                "reward": 0.7 - 0.55 * math.exp(-step / 25) + rng.gauss(0, 0.02),
                # groups go all-correct / all-wrong from step ~80 (zero_std)
                "frac_reward_zero_std": min(0.12 + 0.6 / (1 + math.exp(-(step - 82) / 3)) + rng.gauss(0, 0.03), 1),
                # the gradient dies after step ~100 (grad_norm_vanishing)
                "grad_norm": 0.5 * (1 + rng.uniform(-0.1, 0.1)) * (1 if step < 100 else math.exp(-(step - 100) / 3)),
                # completions creep toward the cap of 128 and get truncated (length_near_cap)
                "completions/mean_length": 38 + 60 * (step / n) ** 2 + rng.gauss(0, 1.5),
                "completions/clipped_ratio": max(0.0, (step - 120) / 70 + rng.gauss(0, 0.03)),
                "entropy": 2.2 * math.exp(-step / 120) + rng.gauss(0, 0.03),
                # a precision change between steps 40 and 55 (mismatch)
                "mismatch/logp_abs_diff/mean": (0.024 if 40 <= step < 56 else 0.0035) * (1 + rng.uniform(-0.2, 0.2)),
                "mismatch/logp_abs_diff/max": (0.3 if 40 <= step < 56 else 0.045) * (1 + rng.uniform(-0.2, 0.2)),
            }
        )
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ppo", help="output dir of the README's PPO command (its health.jsonl)")
    cli = parser.parse_args()
    out = render_dashboard(
        synthetic_history(),
        Path(__file__).with_name("dashboard.png"),
        max_completion_length=128,
        title="synthetic GRPO run (150 steps)",
    )
    print(f"wrote {out}")
    if cli.ppo:
        title = "PPO, the README's main command (sentiment, embedded default, 160 steps)"
        out = render_dashboard(cli.ppo, Path(__file__).with_name("dashboard_ppo.png"), title=title)
        print(f"wrote {out}")
