"""GDPO vs GRPO (sum, then normalise) on two rewards of different scales: does each reward still move?

Task (8 prompts, 8 completion tokens, two reward functions whose maxima are reachable together):

- `coverage`, large scale and dense: `--scale` x the share of completion tokens that lie in one random set of
  `--coverage-tokens` ids (12% of the vocabulary: about 1.2 at step 0, at most `--scale`);
- `answer`, 0/1 and sparse: 1 if the first completion token is in the prompt's own answer set, 32 ids drawn from the
  coverage set (3% at step 0; 25% for a first token drawn uniformly from the coverage set).

Arms: `grpo` (TRL's default `multi_objective_aggregation="sum_then_normalize"`: the summed reward is z-scored per
group, so the answer's 0/1 is small next to the coverage's spread) and `gdpo` (`advantage_estimator="gdpo"`: each
reward z-scored per group, then summed and z-scored over the batch). Reported per reward: its curve, the last-steps
mean and the steps to a level.

    python benchmarks/exp_gdpo.py             # 5 seeds x 2 arms x 80 steps, 1-4 minutes on 2 CPU cores
    python benchmarks/exp_gdpo.py --quick     # CI smoke test
"""

from __future__ import annotations

import exp_common as common
import numpy as np
import torch

from trl_stable.testing import build_causal_lm, build_tokenizer

ARMS = ("grpo", "gdpo")


def make_run(args, tokenizer):
    def run(arm: str, seed: int):
        cover = common.random_token_sets(len(tokenizer), [args.coverage_tokens], seed=2000 + seed)[0]
        generator = torch.Generator().manual_seed(2100 + seed)
        # each prompt's answers are a subset of the coverage tokens: both rewards can reach their maximum together
        answers = {
            p: {cover[i] for i in torch.randperm(len(cover), generator=generator)[:32].tolist()}
            for p in common.PROMPTS
        }
        cover = set(cover)

        def coverage(completion_ids, **kwargs):
            return [args.scale * sum(t in cover for t in ids) / max(len(ids), 1) for ids in completion_ids]

        def answer(prompts, completion_ids, **kwargs):
            return [float(bool(ids) and ids[0] in answers[p]) for p, ids in zip(prompts, completion_ids)]

        _, logs = common.train_grpo(
            build_causal_lm("qwen2", tokenizer, seed=seed),
            tokenizer,
            [coverage, answer],
            seed,
            args.steps,
            advantage_estimator=arm,
            max_completion_length=8,
            learning_rate=args.learning_rate,
        )
        return {
            "coverage": common.column(logs, "rewards/coverage/mean"),
            "answer": common.column(logs, "rewards/answer/mean"),
        }, {}

    return run


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__, steps=80, seeds=5, quick_steps=3)
    p.add_argument("--scale", type=float, default=10.0, help="maximum of the coverage reward (answer's is 1)")
    p.add_argument("--coverage-tokens", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=1e-2)
    args = common.finish_args(p.parse_args(argv), "exp_gdpo")
    tokenizer = build_tokenizer()
    print(f"GDPO vs GRPO: {args.seeds} seeds x {ARMS}, {args.steps} steps, coverage scale {args.scale}")
    runs = common.run_seeds(ARMS, args.seeds, make_run(args, tokenizer))

    tail = max(1, args.steps // 10)
    levels = {"coverage": args.scale / 2, "answer": 0.5}
    rows, summary = [], {}
    for arm in ARMS:
        row, summary[arm] = [arm], {}
        for name in ("coverage", "answer"):
            curve = runs.matrix(arm, name)
            start, final = curve[:, :tail].mean(axis=1), curve[:, -tail:].mean(axis=1)
            reach = np.array([common.steps_to(c, levels[name]) for c in curve])
            summary[arm][name] = {"start": start.tolist(), "final": final.tolist(), "steps_to": reach.tolist()}
            row += [
                common.med_range(start, "{:.2f}"),
                common.med_range(final, "{:.2f}"),
                common.med_range(reach, "{:.0f}"),
            ]
        rows.append(row)
    common.print_table(
        f"median (min-max) over {args.seeds} seeds; first / last {tail} steps",
        [
            "arm",
            "coverage, start",
            "coverage, end",
            f"steps to coverage {levels['coverage']:g}",
            "answer, start",
            "answer, end",
            "steps to answer 0.5",
        ],
        rows,
    )
    if args.png:
        fig, axes = common.figure(2)
        labels = {arm: arm.upper() for arm in ARMS}
        common.arm_bands(axes[0], runs, ARMS, "coverage", labels, window=5)
        common.arm_bands(axes[1], runs, ARMS, "answer", labels, window=5)
        axes[0].set(title=f"coverage reward (scale 0-{args.scale:g})", xlabel="step", ylabel="5-step mean")
        axes[0].set_ylim(0, args.scale)
        axes[1].axhline(0.25, color="gray", ls="--", lw=1, label="first token uniform over the coverage set")
        axes[1].set(title="answer reward (0/1)", xlabel="step", ylabel="5-step mean", ylim=(0, 1))
        for ax in axes:
            ax.legend(loc="upper left", fontsize=8)
        title = f"GDPO vs GRPO, two rewards of different scales; median and min-max over {args.seeds} seeds"
        common.save(fig, args.png, title)
    return summary


if __name__ == "__main__":
    common.quiet()
    main()
