"""PPO baseline vs PPO + intrinsic critic rewards on the embedded sentiment experiment (RELC's main claim).

Both arms run `examples/research_projects/sentiment/ppo_intrinsic.py` on its embedded default with the same seeds
and the same number of PPO steps; the intrinsic arm adds the offline lexicon critic's per-token rewards (+0.5 in a
positive span, -0.5 in a negative one, every sample critiqued; the embedded defaults: the AFINN lexicon, the
per-sample sum bounded by 0.5). Measured side by side, per arm (mean over seeds):

- steps to reach the target environment reward (5-step moving average of the VADER compound score of
  query + response; runs that never reach it count as the budget and are reported as such), and their ratio;
- final environment reward (mean of the last 10 steps) and final KL to the reference;
- on the shipped neutral prompts (`eval_scripts/neutral_prompts.jsonl`, `--num_return` samples each, top-p 0.9,
  20 tokens): positive rate (VADER p > 0.5), conditional perplexity under the untrained embedded policy, dist-1/2/3.

The numbers in docs/research_reproductions.md were measured with the earlier embedded critic, which read VADER's
own lexicon with RELC's unbounded +-0.5 per token (`--intrinsic_flags "--critic_lexicon vader
--intrinsic_reward_max_sum None"` reruns it). `benchmarks/exp_relc_dense.py` compares the critics on more seeds,
judged on held-out prompts by an evaluator that is neither the reward nor the critic and at matched KL.

    python benchmarks/bench_sentiment_intrinsic.py                       # 3 seeds x 120 steps, a few minutes on CPU
    python benchmarks/bench_sentiment_intrinsic.py --seeds 0 1 2 3 4 --steps 160 --output_dir outputs/bench_sentiment

Writes `results.json`, `results.md` and `reward_curves.png` under `--output_dir`.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import time
from pathlib import Path

from exp_common import examples_on_path, load_example

examples_on_path()
from embedded import embedded_policy  # noqa: E402
from reward_curve import plot_reward_curve, smooth  # noqa: E402
from script_args import parse_script_args  # noqa: E402

ARMS = {"ppo_baseline": [], "ppo_intrinsic": ["--use_intrinsic_reward"]}


def steps_to_reach(rewards: list[float], target: float, window: int = 5) -> int | None:
    """First step (1-based) at which the trailing `window`-step mean reward is >= target; None if never."""
    for i, value in enumerate(smooth(rewards, window)):
        if i + 1 >= window and value >= target:
            return i + 1
    return None


def evaluate_run(model_dir: str, num_prompts: int | None, num_return: int, seed: int) -> dict[str, float]:
    import eval_sentiment

    summary = eval_sentiment.evaluate(
        eval_sentiment.SentimentEvalArgs(
            models=[model_dir],
            names=["run"],
            num_prompts=num_prompts,
            num_return=num_return,
            with_fluency=True,
            scoring_model="embedded:sentiment",
            output_dir=str(Path(model_dir) / "eval"),
            seed=seed,
        )
    )
    return summary["run"]


def mean_std(values: list[float]) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=120, help="PPO steps per run (the same budget for both arms)")
    parser.add_argument("--target", type=float, default=0.4, help="environment reward to reach (VADER compound)")
    parser.add_argument("--num_prompts", type=int, default=None, help="neutral prompts to evaluate (default all 40)")
    parser.add_argument("--num_return", type=int, default=5, help="samples per neutral prompt")
    parser.add_argument("--output_dir", default="outputs/bench_sentiment_intrinsic")
    parser.add_argument(
        "--intrinsic_flags",
        default="",
        help='extra flags of the intrinsic arm, e.g. "--positive_reward_value 0.1 --negative_reward_value -0.1"',
    )
    cli = parser.parse_args()
    arms = {**ARMS, "ppo_intrinsic": ARMS["ppo_intrinsic"] + shlex.split(cli.intrinsic_flags)}

    script = load_example("sentiment/ppo_intrinsic.py")
    out = Path(cli.output_dir)
    results: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    curves: dict[str, list[list[float]]] = {arm: [] for arm in ARMS}
    for seed in cli.seeds:
        embedded_policy("sentiment", seed=seed)  # warm-up (cached) outside the timed runs: the first arm paid it
        for arm, flags in arms.items():
            run_dir = out / f"{arm}_seed{seed}"
            argv = [*flags, "--max_steps", str(cli.steps), "--model_save_path", str(run_dir)]
            argv += ["--ppo_config.seed", str(seed)]
            start = time.time()
            history = script.main(parse_script_args(script.ScriptArguments, argv))
            train_s = time.time() - start
            rewards = [h["env_reward"] for h in history]
            curves[arm].append(rewards)
            row = {
                "seed": seed,
                "steps_to_target": steps_to_reach(rewards, cli.target),
                "final_reward": statistics.mean(rewards[-10:]),
                "final_kl": statistics.mean(h["kl"] for h in history[-10:]),
                "train_seconds": train_s,
                **evaluate_run(str(run_dir), cli.num_prompts, cli.num_return, seed),
            }
            results[arm].append(row)
            print(json.dumps({"arm": arm, **row}))

    def steps(arm: str) -> list[float]:
        return [r["steps_to_target"] if r["steps_to_target"] is not None else cli.steps for r in results[arm]]

    metrics = ["final_reward", "final_kl", "positive_rate", "perplexity", "dist-1", "dist-2", "dist-3"]
    metrics.append("train_seconds")
    lines = [
        f"Embedded sentiment, {len(cli.seeds)} seeds x {cli.steps} PPO steps, target reward {cli.target} "
        f"(5-step moving average of VADER compound), eval on {cli.num_prompts or 40} neutral prompts x "
        f"{cli.num_return} samples.",
        "",
        "| arm | steps to target (unreached = budget) | reached | " + " | ".join(metrics) + " |",
        "|---|---|---|" + "---|" * len(metrics),
    ]
    for arm in ARMS:
        reached = sum(r["steps_to_target"] is not None for r in results[arm])
        cells = [mean_std([r[m] for r in results[arm]]) for m in metrics]
        lines.append(f"| {arm} | {mean_std(steps(arm))} | {reached}/{len(cli.seeds)} | " + " | ".join(cells) + " |")
    ratio = statistics.mean(steps("ppo_baseline")) / max(statistics.mean(steps("ppo_intrinsic")), 1e-9)
    pos = statistics.mean(r["positive_rate"] for r in results["ppo_intrinsic"]) / max(
        statistics.mean(r["positive_rate"] for r in results["ppo_baseline"]), 1e-9
    )
    ppl = statistics.mean(r["perplexity"] for r in results["ppo_intrinsic"]) / max(
        statistics.mean(r["perplexity"] for r in results["ppo_baseline"]), 1e-9
    )
    lines += [
        "",
        f"steps-to-target ratio baseline / intrinsic: {ratio:.2f}x (> 1: the intrinsic arm gets there sooner)",
        f"positive-rate ratio intrinsic / baseline: {pos:.2f}x",
        f"perplexity ratio intrinsic / baseline: {ppl:.2f}x (> 1: less fluent under the initial policy)",
    ]
    table = "\n".join(lines)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(table + "\n", encoding="utf-8")
    summary = {"args": vars(cli), "runs": results, "steps_ratio": ratio, "positive_rate_ratio": pos, "ppl_ratio": ppl}
    (out / "results.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    mean_curves = {
        arm: [{"step": i + 1, "env_reward": statistics.mean(c[i] for c in runs)} for i in range(cli.steps)]
        for arm, runs in curves.items()
    }
    plot_reward_curve(mean_curves, str(out / "reward_curves.png"))


if __name__ == "__main__":
    main()
