"""NGRPO vs GRPO where most groups are all wrong at the start: learning progress and the share of zero-gradient groups.

Task: 8 prompts, each with its own random set of `--targets` answer tokens out of the tiny vocabulary (1,030 ids);
reward 1 if the first completion token is in the prompt's set, else 0 (a verifiable 0/1 reward, as in RLVR). The
starting policies (`--inits`):

- `random`: the kit's random initialisation, close to uniform: P(correct) = 32/1030 = 3% per sample, so about 78% of
  the groups of 8 are all wrong at step 0;
- `confident`: the same model first fitted (soft-target cross-entropy) to put `--wrong-prob` of its first-token mass on
  one wrong token per prompt (a policy that is confidently wrong on hard prompts): P(correct) about 0.6%, about 95% of
  the groups all wrong;
- `plausible` (not in the default run): 80% on the wrong token, 15% on 16 alternatives of which 4 are right, 5%
  uniform (a policy whose second choices include the answer).

Arms: `grpo` (TRL's group mean / std) and `ngrpo` (`advantage_estimator="ngrpo"`: one virtual sample of reward 1 per
group, so an all-wrong group gets A = -1/3 per sample instead of 0). A group gives no gradient when all its
advantages are 0: under GRPO when its rewards are all equal, under NGRPO only when they are all 1. On-policy (one
update per batch, ratio 1), so NGRPO's asymmetric clipping would not act and is not part of the comparison.

    python benchmarks/exp_ngrpo.py             # 5 seeds x 2 arms x 2 inits x 100 steps, 3-8 minutes on 2 CPU cores
    python benchmarks/exp_ngrpo.py --quick     # CI smoke test
"""

from __future__ import annotations

import exp_common as common
import numpy as np
import torch

from trl_stable.testing import build_causal_lm, build_tokenizer

ARMS = ("grpo", "ngrpo")


def warm_start(model, tokenizer, targets: dict[str, torch.Tensor], steps: int = 60) -> None:
    """Fit the first-token distribution of every prompt to `targets[prompt]` (soft-target cross-entropy)."""
    ids = {p: torch.tensor([tokenizer(p)["input_ids"]]) for p in targets}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = 0.0
        for prompt, target in targets.items():
            loss = loss - (target * torch.log_softmax(model(ids[prompt]).logits[0, -1], -1)).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)


def start_distribution(init: str, vocab: int, wrong: int, alternatives: list[int], prob: float) -> torch.Tensor:
    """`confident`: `prob` on the wrong token, the rest uniform over the other tokens; `plausible`: `prob` on the
    wrong token, 3/4 of the rest on 16 alternatives (4 of them correct), 1/4 uniform over the other tokens."""
    rest = 1 - prob
    others = torch.ones(vocab)
    others[wrong] = 0.0
    target = others / others.sum() * (rest if init == "confident" else rest / 4)
    if init == "plausible":
        target[alternatives] += rest * 3 / 4 / len(alternatives)
    target[wrong] = prob
    return target


def make_run(args, tokenizer):
    def run(key: str, seed: int):
        init, arm = key.split("/")
        vocab = len(tokenizer)
        # per prompt: [wrong token, 12 wrong alternatives, `targets` answer tokens]
        sets = common.random_token_sets(vocab, [1 + 12 + args.targets] * len(common.PROMPTS), seed=1000 + seed)
        targets = {p: set(s[13:]) for p, s in zip(common.PROMPTS, sets, strict=True)}
        model = build_causal_lm("qwen2", tokenizer, seed=seed)
        if init != "random":
            starts = {
                p: start_distribution(init, vocab, s[0], s[1:17], args.wrong_prob)
                for p, s in zip(common.PROMPTS, sets)
            }
            warm_start(model, tokenizer, starts)
        zero_grad = []

        def first_token_correct(prompts, completion_ids, **kwargs):
            rewards = [float(bool(ids) and ids[0] in targets[p]) for p, ids in zip(prompts, completion_ids)]
            groups = np.asarray(rewards).reshape(-1, args.num_generations)
            homogeneous = groups.min(axis=1) == groups.max(axis=1)
            # NGRPO's virtual max-reward sample gives an all-wrong group a gradient; only all-right groups have none
            dead = homogeneous if arm == "grpo" else homogeneous & (groups.min(axis=1) == 1.0)
            zero_grad.append(float(dead.mean()))
            return rewards

        _, logs = common.train_grpo(
            model,
            tokenizer,
            [first_token_correct],
            seed,
            args.steps,
            advantage_estimator=arm,
            num_generations=args.num_generations,
            per_device_train_batch_size=args.num_generations * 4,
            max_completion_length=2,
            learning_rate=args.learning_rate,
        )
        reward = common.column(logs, "reward")
        homogeneous = common.column(logs, "frac_reward_zero_std")  # TRL's count of groups whose rewards are all equal
        return {
            "reward": reward,
            "zero_grad": zero_grad[: len(reward)],
            "homogeneous": homogeneous,
            "entropy": common.column(logs, "entropy"),
            "grad_norm": common.column(logs, "grad_norm"),
        }, {}

    return run


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__, steps=100, seeds=5, quick_steps=3)
    p.add_argument("--inits", default="random,confident", help="comma-separated: random, confident, plausible")
    p.add_argument("--targets", type=int, default=32, help="answer tokens per prompt")
    p.add_argument(
        "--wrong-prob", type=float, default=0.8, help="first-token mass on the wrong token (confident, plausible)"
    )
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=2e-2)
    p.add_argument("--level", type=float, default=0.5, help="reward level for 'steps to level'")
    args = common.finish_args(p.parse_args(argv), "exp_ngrpo")
    tokenizer = build_tokenizer()
    inits = args.inits.split(",")
    keys = [f"{init}/{arm}" for init in inits for arm in ARMS]
    print(f"NGRPO vs GRPO: {args.seeds} seeds x {keys}, {args.steps} steps")
    runs = common.run_seeds(keys, args.seeds, make_run(args, tokenizer))

    rows, summary = [], {}
    tail = max(1, args.steps // 10)
    for key in keys:
        reward, dead = runs.matrix(key, "reward"), runs.matrix(key, "zero_grad")
        stats = {
            "zero_grad_start": dead[:, :tail].mean(axis=1),
            "zero_grad_mean": dead.mean(axis=1),
            "reward_final": reward[:, -tail:].mean(axis=1),
            "steps_to_level": np.array([common.steps_to(r, args.level) for r in reward]),
            "entropy_start": runs.matrix(key, "entropy")[:, :tail].mean(axis=1),
            "entropy_final": runs.matrix(key, "entropy")[:, -tail:].mean(axis=1),
            "grad_norm_final": runs.matrix(key, "grad_norm")[:, -tail:].mean(axis=1),
        }
        summary[key] = {k: v.tolist() for k, v in stats.items()}
        summary[key]["zero_grad"] = dead.tolist()
        summary[key]["trl_frac_reward_zero_std"] = runs.matrix(key, "homogeneous").tolist()
        rows.append(
            [
                key,
                common.med_range(stats["zero_grad_start"], "{:.2f}"),
                common.med_range(stats["zero_grad_mean"], "{:.2f}"),
                common.med_range(stats["reward_final"], "{:.2f}"),
                common.med_range(stats["steps_to_level"], "{:.0f}"),
                common.med_range(stats["entropy_start"], "{:.2f}"),
                common.med_range(stats["entropy_final"], "{:.2f}"),
                common.med_range(stats["grad_norm_final"], "{:.3f}"),
            ]
        )
    common.print_table(
        f"median (min-max) over {args.seeds} seeds; zero-gradient groups = groups whose advantages are all 0",
        [
            "init/arm",
            f"zero-grad groups, first {tail} steps",
            "zero-grad groups, whole run",
            f"reward, last {tail} steps",
            f"steps to reward {args.level}",
            f"entropy (nats), first {tail} steps",
            f"entropy, last {tail} steps",
            f"grad norm, last {tail} steps",
        ],
        rows,
    )
    if args.png:
        fig, axes = common.figure(2, nrows=len(inits), width=5.0, height=3.4)
        for i, init in enumerate(inits):
            ax_r, ax_z = axes[2 * i], axes[2 * i + 1]
            keys = [f"{init}/{arm}" for arm in ARMS]
            labels = {f"{init}/{arm}": arm.upper() for arm in ARMS}
            common.arm_bands(ax_r, runs, keys, "reward", labels, window=5)
            common.arm_bands(ax_z, runs, keys, "zero_grad", labels, window=5)
            ax_r.set(title=f"{init} init: training reward", xlabel="step", ylabel="reward (5-step mean)", ylim=(0, 1))
            ax_z.set(title=f"{init} init: groups with zero gradient", xlabel="step", ylabel="share", ylim=(0, 1.02))
            ax_r.legend(loc="upper left")
            ax_z.legend(loc="upper right")
        common.save(fig, args.png, f"NGRPO vs GRPO, first-token 0/1 task; median and min-max over {args.seeds} seeds")
    return summary


if __name__ == "__main__":
    common.quiet()
    main()
