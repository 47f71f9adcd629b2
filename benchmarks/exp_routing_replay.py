"""Routing replay on a tiny MoE under router drift: the training-reward curve with and without replay.

Policy: the kit's tiny Qwen3-MoE (2 MoE layers, 4 experts, top-2) with `initializer_range=--init-range` and its
experts' output projections scaled by `--expert-scale`, so that the MoE layers carry the residual stream and sending a
token to other experts moves its log-prob by up to ~1 nat at step 0 (at the kit's defaults the experts are
near-zero functions and no routing change is visible in the log-probs).

Router drift: routing that is not reproducible from one forward pass to the next, as between an inference engine and
a trainer, or across repeated passes of one engine. In every forward pass (generation, TRL's old-logprob pass,
trl_stable's proximal pass, every update) each router picks its top-k from its logits plus fresh Gaussian noise of
`--drift` x the std of those logits; the gates are the family's own, computed from the clean logits at the chosen
experts. So only near-tie choices flip, and a pass with replayed experts computes exactly what the recorded pass did.

Task: 8 prompts, 8 completion tokens, reward = share of completion tokens in one random set of 128 ids (12% at
step 0). Two settings, each with its arms (same weights, prompts and noise draws per seed):

- `r3`: on-policy, the sampler's log-probs in the loss (`use_decoupled_loss=True`, no token filter). Arms `off` and
  `R3` (the proximal pass and the update replay the sampler's experts).
- `r2`: `num_iterations=4` updates per generation batch against TRL's old-logprob pass (plain loss). Arms `off` and
  `R2` (the updates replay the old-logprob pass's experts); `--r2-steps` optimizer steps (a quarter of them
  generate).

Reported: the reward curve of the sampler's completions, its peak and last-steps mean, and the ratio spread the loss
sees: `behaviour_weight/max` for r3; for r2 TRL's `clip_ratio/region_mean` (the clipped token share) at the first
update of each batch, which runs at the old-logprob pass's weights, so only routing can move its ratio off 1.

    python benchmarks/exp_routing_replay.py             # 5 seeds x 2 settings x 2 arms, ~5 minutes on 2 CPUs
    python benchmarks/exp_routing_replay.py --quick     # CI smoke test
"""

from __future__ import annotations

import exp_common as common
import numpy as np
import torch

from trl_stable.moe import SUPPORTED_ROUTERS
from trl_stable.moe.adapters import adapter_for
from trl_stable.testing import build_causal_lm, build_tokenizer

SCENARIO_ARMS = {"r3": ("off", "R3"), "r2": ("off", "R2")}


def routers(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ in SUPPORTED_ROUTERS]


class NoisyRouting:
    """Every forward pass picks each router's top-k from `logits + noise` (fresh noise, `std` x the logits' std);
    the gates come from the family's gating (`trl_stable.moe.adapters`) on the clean logits at those experts.

    Hooked first on each router (``prepend=True``), so routing replay, hooked later, records these choices and its
    replay overrides them.
    """

    def __init__(self, model, std: float, seed: int):
        self.std = std
        self.generator = torch.Generator().manual_seed(seed)
        self.handles = [r.register_forward_hook(self._hook, prepend=True) for r in routers(model)]

    def _hook(self, module, args, output):
        logits, _, _ = output
        clean = logits.detach()
        noise = torch.randn(clean.shape, generator=self.generator).to(clean) * self.std * clean.std()
        index = (clean + noise).topk(module.top_k, dim=-1).indices
        return logits, adapter_for(module).gate(module, logits, index), index


def drifting_moe(tokenizer, seed: int, init_range: float, expert_scale: float):
    model = build_causal_lm("qwen3_moe", tokenizer, seed=seed, initializer_range=init_range)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("experts.down_proj"):
                param.mul_(expert_scale)
    return model


def make_run(args, tokenizer):
    def run(key: str, seed: int):
        scenario, arm = key.split("/")
        in_target_share = common.target_share_reward(tokenizer, seed=4000 + seed)
        model = drifting_moe(tokenizer, seed, args.init_range, args.expert_scale)
        NoisyRouting(model, args.drift, seed=5000 + seed)  # the hooks keep it alive with the model
        config = {"routing_replay": arm}
        if scenario == "r3":
            config["use_decoupled_loss"] = True
        else:
            config["num_iterations"] = 4
        trainer_logs = common.train_grpo(
            model,
            tokenizer,
            [in_target_share],
            seed,
            args.steps if scenario == "r3" else args.r2_steps,
            max_completion_length=8,
            learning_rate=args.learning_rate,
            **config,
        )[1]
        # r2: the reward is logged on the steps that generate, the first update of each batch, which runs at the
        # weights of the old-logprob pass: there only the routing can move the ratio off 1
        generated = ~np.isnan(common.column(trainer_logs, "reward"))
        spread_key = "behaviour_weight/max" if scenario == "r3" else "clip_ratio/region_mean"
        return {
            "reward": np.asarray(common.column(trainer_logs, "reward"))[generated],
            "spread": np.asarray(common.column(trainer_logs, spread_key))[generated],
            "step": np.flatnonzero(generated) + 1,
        }, {}

    return run


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__, steps=60, seeds=5, quick_steps=3)
    p.add_argument("--scenarios", default="r3,r2", help="comma-separated: r3, r2")
    p.add_argument("--r2-steps", type=int, default=120, help="optimizer steps of the r2 runs (4 per batch)")
    p.add_argument("--drift", type=float, default=0.1, help="routing noise, in units of the router logits' std")
    p.add_argument("--expert-scale", type=float, default=10.0, help="factor on the experts' output projections")
    p.add_argument("--learning-rate", type=float, default=1e-2)
    p.add_argument(
        "--init-range",
        type=float,
        default=0.2,
        help="initializer_range of the MoE (the kit's default is 0.02)",
    )
    args = common.finish_args(p.parse_args(argv), "exp_routing_replay")
    if args.quick:
        args.r2_steps = 4
    tokenizer = build_tokenizer()
    scenarios = args.scenarios.split(",")
    keys = [f"{s}/{arm}" for s in scenarios for arm in SCENARIO_ARMS[s]]
    print(f"Routing replay: {args.seeds} seeds x {keys}, {args.steps} steps, drift {args.drift}")
    runs = common.run_seeds(keys, args.seeds, make_run(args, tokenizer))

    rows, summary = [], {}
    for key in keys:
        reward, spread = runs.matrix(key, "reward"), runs.matrix(key, "spread")
        tail, window = max(1, reward.shape[1] // 10), min(5, reward.shape[1])
        smooth_peak = np.array([np.convolve(r, np.ones(window) / window, mode="valid").max() for r in reward])
        final = reward[:, -tail:].mean(axis=1)
        summary[key] = {"final": final.tolist(), "peak": smooth_peak.tolist(), "spread_first": spread[:, 0].tolist()}
        rows.append(
            [
                key,
                common.med_range(reward[:, :tail].mean(axis=1), "{:.3f}"),
                common.med_range(smooth_peak, "{:.3f}"),
                common.med_range(final, "{:.3f}"),
                common.med_range(smooth_peak - final, "{:.3f}"),
                common.med_range(np.nanmedian(spread, axis=1), "{:.3g}"),
            ]
        )
    common.print_table(
        f"median (min-max) over {args.seeds} seeds, per generation batch; spread = behaviour_weight/max (r3), or the "
        "clipped token share at the first update of a batch, whose weights are the old-logprob pass's (r2)",
        [
            "scenario/arm",
            "reward, first 10%",
            "peak (5-batch mean)",
            "reward, last 10%",
            "drop from peak",
            "ratio spread, median step",
        ],
        rows,
    )
    if args.png:
        fig, axes = common.figure(len(scenarios), nrows=2, width=5.0, height=3.3)
        titles = {
            "r3": "on-policy, sampler log-probs in the loss",
            "r2": "4 updates per batch (old-logprob pass)",
        }
        spread_labels = {
            "r3": "max behaviour weight per batch",
            "r2": "clipped token share, 1st update of a batch",
        }
        for i, scenario in enumerate(scenarios):
            ax_r, ax_s = axes[i], axes[len(scenarios) + i]
            keys = [f"{scenario}/{arm}" for arm in SCENARIO_ARMS[scenario]]
            labels = {f"{scenario}/{arm}": f"replay {arm}" for arm in SCENARIO_ARMS[scenario]}
            # the reward is logged on the steps that generate: every step (r3), one in four (r2)
            x = runs.matrix(keys[0], "step")[0]
            window = 5 if scenario == "r3" else 2
            common.arm_bands(ax_r, runs, keys, "reward", labels, window=window, x=x)
            common.arm_bands(ax_s, runs, keys, "spread", labels, window=window, x=x)
            ax_r.set(title=titles[scenario], xlabel="optimizer step", ylabel="training reward (smoothed)")
            ax_s.set(title=spread_labels[scenario], xlabel="optimizer step")
            ax_r.legend(loc="upper left")
            ax_s.legend(loc="upper right")
        title = (
            f"Routing replay, tiny Qwen3-MoE, routing noise {args.drift}x logit std; median and min-max over "
            f"{args.seeds} seeds"
        )
        common.save(fig, args.png, title)
    return summary


if __name__ == "__main__":
    common.quiet()
    main()
