"""Dense per-token rewards vs their sum on the last token, same PPO, same budget (issue 4's benchmark).

Toy task with a reward that is dense by nature: +1 for every generated token whose id is below `--target_below`
(about 30% of the tiny vocabulary at initialisation). Arm "dense" gives PPO the per-token rewards (a
`dense_reward` function); arm "sparse" gives the same total as one sequence score on the last token. For several
seeds, each arm trains the same tiny policy for `--steps` PPO steps; we report the steps each needs until the moving
average (3 steps) of the per-sample reward reaches `--level`, and the ratio sparse / dense (> 1: dense is faster).

    python benchmarks/bench_ppo_dense.py                     # 3 seeds x 2 arms, ~1-2 minutes on 2 CPU cores
    python benchmarks/bench_ppo_dense.py --seeds 5 --steps 60 --plot ppo_dense.png
"""

from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from trl_stable import PPOConfig, PPOTrainer  # noqa: E402
from trl_stable.rewards import dense_reward  # noqa: E402
from trl_stable.testing import build_causal_lm, build_tokenizer  # noqa: E402

PROMPTS = ["The movie", "A story", "I think", "We saw", "It was", "She said", "They made", "In the end"]


def run_arm(arm: str, seed: int, cli: argparse.Namespace, tokenizer) -> list[float]:
    """Per-step mean reward per sample (the sum of the per-token rewards) of one PPO run."""
    below = cli.target_below

    @dense_reward
    def per_token(prompts, completions, completion_ids, **kwargs):
        return [[1.0 if t < below else 0.0 for t in ids] for ids in completion_ids]

    def summed(prompts, completions, completion_ids, **kwargs):
        return [float(sum(t < below for t in ids)) for ids in completion_ids]

    reward = per_token if arm == "dense" else summed
    with tempfile.TemporaryDirectory() as out:
        args = PPOConfig(
            output_dir=out,
            batch_size=cli.batch_size,
            mini_batch_size=cli.batch_size,
            ppo_epochs=4,
            max_new_tokens=cli.max_new_tokens,
            learning_rate=cli.learning_rate,
            max_steps=cli.steps,
            init_kl_coef=0.0,
            adap_kl_ctrl=False,
            seed=seed,
            report_to="none",
            disable_tqdm=True,
            save_strategy="no",
        )
        model = build_causal_lm(cli.family, tokenizer, seed=seed)
        dataset = Dataset.from_dict({"prompt": PROMPTS * 4})
        trainer = PPOTrainer(model, reward_funcs=reward, args=args, processing_class=tokenizer, train_dataset=dataset)
        trainer.train()
    key = "dense/reward_mean" if arm == "dense" else "env/reward_mean"
    return [h[key] for h in trainer.state.log_history if key in h]


def steps_to_level(curve: list[float], level: float, window: int = 3) -> int | None:
    for i in range(window - 1, len(curve)):
        if sum(curve[i - window + 1 : i + 1]) / window >= level:
            return i + 1
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    parser.add_argument("--target_below", type=int, default=300)
    parser.add_argument("--level", type=float, default=6.0, help="reward level (tokens hit of max_new_tokens)")
    parser.add_argument("--family", default="qwen2")
    parser.add_argument("--plot", default=None, help="write the reward curves to this PNG")
    cli = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()

    curves: dict[str, list[list[float]]] = {"dense": [], "sparse": []}
    runs = [(seed, arm) for seed in range(cli.seeds) for arm in ("dense", "sparse")]
    for seed, arm in tqdm(runs, desc="PPO runs"):
        curves[arm].append(run_arm(arm, seed, cli, tokenizer))

    censored = cli.steps + 1  # a run that never reaches the level counts as steps + 1
    print(f"\nsteps until the 3-step average reward >= {cli.level} (of {cli.max_new_tokens}); '>' = not reached")
    print(f"{'seed':>4} | {'dense':>6} | {'sparse':>6} | {'ratio sparse/dense':>18}")
    totals = {"dense": 0, "sparse": 0}
    for seed in range(cli.seeds):
        row = {}
        for arm in ("dense", "sparse"):
            s = steps_to_level(curves[arm][seed], cli.level)
            row[arm] = s if s is not None else censored
            totals[arm] += row[arm]
        fmt = {a: (str(v) if v <= cli.steps else f">{cli.steps}") for a, v in row.items()}
        print(f"{seed:>4} | {fmt['dense']:>6} | {fmt['sparse']:>6} | {row['sparse'] / row['dense']:>18.2f}")
    final = {a: sum(sum(c[-5:]) / 5 for c in curves[a]) / cli.seeds for a in curves}
    print(
        f"mean | {totals['dense'] / cli.seeds:>6.1f} | {totals['sparse'] / cli.seeds:>6.1f} | "
        f"{totals['sparse'] / totals['dense']:>18.2f}"
    )
    print(
        f"final reward (last 5 steps, mean over seeds): dense {final['dense']:.2f}, sparse {final['sparse']:.2f}, "
        f"ratio dense/sparse {final['dense'] / max(final['sparse'], 1e-9):.2f}"
    )

    if cli.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for arm, color in (("dense", "tab:blue"), ("sparse", "tab:orange")):
            for i, curve in enumerate(curves[arm]):
                ax.plot(range(1, len(curve) + 1), curve, color=color, alpha=0.6, label=arm if i == 0 else None)
        ax.axhline(cli.level, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("PPO step")
        ax.set_ylabel("reward per sample")
        ax.set_title("per-token rewards vs their sum on the last token")
        ax.legend()
        fig.tight_layout()
        fig.savefig(cli.plot)
        print(f"plot written to {cli.plot}")


if __name__ == "__main__":
    main()
