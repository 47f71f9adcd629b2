"""IcePop / KPop under an injected sampler/trainer mismatch: gradient spread and training, with and without the filter.

Mismatch: the sampler is the policy with perturbed logits. During `generate` only, a forward hook on the output
layer divides the logits by `--sampler-temperature` and, at a random `--mismatch-prob` of the positions, adds
Gaussian noise of std `--mismatch-std` to every logit (a stand-in for kernel, precision or MoE routing differences
that hit some tokens hard). The trainer's passes see the unperturbed policy, so the behaviour weight
w = pi_trainer / pi_sampler of the sampled tokens spreads far from 1 on the perturbed positions.

Task: 8 prompts, 8 completion tokens, reward = share of completion tokens in one random set of 128 ids (12% at
step 0). Arms, all with the same mismatched sampler:

- `trl`: TRL's loss without the sampler's log-probs (ratio against the trainer's own old log-probs, which is 1
  on-policy): the mismatch only biases which tokens are sampled;
- `decoupled`: `use_decoupled_loss=True`, no filter: advantages times the raw w;
- `icepop`: + `token_filter="icepop"` (drop tokens with w outside [0.5, 5]);
- `kpop`: + `token_filter="kpop"` (drop tokens whose symmetric binary KL > 2).

Two measurements per seed:

1. Gradient spread at the initial weights: `--grad-batches` fresh batches through the trainer's own step
   (run with learning rate 0), per arm; the relative variance E||g - mean g||^2 / ||mean g||^2 and the cosine of each
   batch gradient with the reference gradient (the mean over as many batches from an *unperturbed* sampler, i.e. the
   on-policy gradient the mismatch corrupts).
2. Training (TRL's grad clipping at 1): the reward of the (mismatched) sampler's completions per step, the grad
   norm before clipping and the masked token share.

    python benchmarks/exp_icepop.py             # 5 seeds x 4 arms x 60 steps, ~5 minutes on 2 CPU cores
    python benchmarks/exp_icepop.py --quick     # CI smoke test
"""

from __future__ import annotations

from contextlib import contextmanager

import exp_common as common
import numpy as np
import torch
from transformers import TrainerCallback

from trl_stable.testing import build_causal_lm, build_tokenizer

ARMS = ("trl", "decoupled", "icepop", "kpop")
ARM_CONFIG = {
    "reference": {"use_decoupled_loss": True},
    "trl": {},
    "decoupled": {"use_decoupled_loss": True},
    "icepop": {"use_decoupled_loss": True, "token_filter": "icepop"},
    "kpop": {"use_decoupled_loss": True, "token_filter": "kpop"},
}
LABELS = {
    "trl": "TRL loss (no sampler log-probs)",
    "decoupled": "decoupled, no filter",
    "icepop": "+ IcePop",
    "kpop": "+ KPop",
}


class MismatchedSampler:
    """Perturbs the output-layer logits while `model.generate` runs (the trainer's own passes are untouched).

    Installed by wrapping the model instance's public `generate`; the noise has its own seeded generator.
    """

    def __init__(self, model, prob: float, std: float, temperature: float, seed: int):
        self.model, self.prob, self.std, self.temperature = model, prob, std, temperature
        self.generator = torch.Generator().manual_seed(seed)
        self.active = prob > 0 and std > 0 or temperature != 1.0
        original = model.generate

        def generate(*args, **kwargs):
            with self.perturbed():
                return original(*args, **kwargs)

        model.generate = generate

    @contextmanager
    def perturbed(self):
        if not self.active:
            yield
            return
        handle = self.model.get_output_embeddings().register_forward_hook(self._hook)
        try:
            yield
        finally:
            handle.remove()

    def _hook(self, module, inputs, output):
        logits = output.float() / self.temperature
        hit = torch.rand(logits.shape[:-1], generator=self.generator) < self.prob
        noise = torch.randn(logits.shape, generator=self.generator) * self.std
        return (logits + noise * hit.unsqueeze(-1)).to(output.dtype)


def task(tokenizer, seed: int):
    return common.target_share_reward(tokenizer, seed=3000 + seed)


class GradientRecorder(TrainerCallback):
    """Keeps every step's full gradient (flattened, before the optimizer step)."""

    def __init__(self, model):
        self.model, self.grads = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append(torch.cat([p.grad.flatten() for p in self.model.parameters() if p.grad is not None]))


def batch_gradients(args, tokenizer, seed: int, arm: str, mismatch: bool) -> np.ndarray:
    """[grad_batches, num_params] gradients of fresh batches at the initial weights.

    The trainer's own step, run with learning rate 0 and no clipping, so every step sees the same weights and a new
    batch (new prompts, new samples, new sampler noise).
    """
    model = build_causal_lm("qwen2", tokenizer, seed=seed)
    MismatchedSampler(model, *_mismatch(args, mismatch), seed=10_000 + seed)
    recorder = GradientRecorder(model)
    common.train_grpo(
        model,
        tokenizer,
        [task(tokenizer, seed)],
        seed,
        args.grad_batches,
        max_completion_length=8,
        learning_rate=0.0,
        max_grad_norm=0.0,
        callbacks=[recorder],
        **ARM_CONFIG[arm],
    )
    return torch.stack(recorder.grads).double().numpy()


def _mismatch(args, on: bool) -> tuple[float, float, float]:
    return (args.mismatch_prob, args.mismatch_std, args.sampler_temperature) if on else (0.0, 0.0, 1.0)


def make_run(args, tokenizer):
    references: dict[int, np.ndarray] = {}

    def run(arm: str, seed: int):
        if seed not in references:
            references[seed] = batch_gradients(args, tokenizer, seed, "reference", mismatch=False).mean(axis=0)
        ref = references[seed]
        grads = batch_gradients(args, tokenizer, seed, arm, mismatch=True)
        mean = grads.mean(axis=0)
        rel_var = float(((grads - mean) ** 2).sum(axis=1).mean() / (mean @ mean))
        cos = grads @ ref / (np.linalg.norm(grads, axis=1) * np.linalg.norm(ref))

        model = build_causal_lm("qwen2", tokenizer, seed=seed)
        MismatchedSampler(model, *_mismatch(args, True), seed=20_000 + seed)
        _, logs = common.train_grpo(
            model,
            tokenizer,
            [task(tokenizer, seed)],
            seed,
            args.steps,
            max_completion_length=8,
            learning_rate=args.learning_rate,
            **ARM_CONFIG[arm],
        )
        masked_key = {"icepop": "token_filter/icepop/masked_token_frac", "kpop": "token_filter/kpop/masked_token_frac"}
        metrics = {
            "reward": common.column(logs, "reward"),
            "grad_norm": common.column(logs, "grad_norm"),
            "w_max": common.column(logs, "behaviour_weight/max"),
        }
        if arm in masked_key:
            metrics["masked"] = common.column(logs, masked_key[arm])
        return metrics, {"rel_var": rel_var, "cos_median": float(np.median(cos))}

    return run


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__, steps=60, seeds=5, quick_steps=2)
    p.add_argument("--mismatch-prob", type=float, default=0.25, help="share of sampler positions with logit noise")
    p.add_argument("--mismatch-std", type=float, default=2.0, help="std of that noise (logit units)")
    p.add_argument("--sampler-temperature", type=float, default=1.0, help="extra sampler-only temperature")
    p.add_argument("--grad-batches", type=int, default=12, help="batches per gradient-spread estimate")
    p.add_argument("--learning-rate", type=float, default=1e-2)
    p.add_argument("--level", type=float, default=0.9, help="reward level for 'steps to level'")
    args = p.parse_args(argv)
    quick = args.quick
    args = common.finish_args(args, "exp_icepop")
    if quick:
        args.grad_batches = 2
    tokenizer = build_tokenizer()
    print(
        f"IcePop/KPop: {args.seeds} seeds x {ARMS}, {args.steps} steps; sampler noise p={args.mismatch_prob} "
        f"std={args.mismatch_std}, temperature x{args.sampler_temperature}"
    )
    runs = common.run_seeds(ARMS, args.seeds, make_run(args, tokenizer))

    tail = max(1, args.steps // 10)
    rows, summary = [], {}
    for arm in ARMS:
        reward, gnorm = runs.matrix(arm, "reward"), runs.matrix(arm, "grad_norm")
        masked = runs.matrix(arm, "masked").mean(axis=1) if "masked" in runs.curves[arm] else None
        final = reward[:, -tail:].mean(axis=1)
        peak_to_end = reward.max(axis=1) - final
        reach = np.array([common.steps_to(r, args.level) for r in reward])
        gmed = np.median(gnorm, axis=1)
        gtail = np.percentile(gnorm, 95, axis=1) / gmed
        summary[arm] = {
            "rel_var": runs.extra[arm]["rel_var"],
            "cos_median": runs.extra[arm]["cos_median"],
            "reward_final": final.tolist(),
            "grad_norm_median": gmed.tolist(),
            "grad_norm_tail": gtail.tolist(),
            "steps_to_level": reach.tolist(),
            "masked": None if masked is None else masked.tolist(),
        }
        rows.append(
            [
                LABELS[arm],
                common.med_range(runs.extra[arm]["rel_var"], "{:.1f}"),
                common.med_range(runs.extra[arm]["cos_median"], "{:.2f}"),
                common.med_range(gmed, "{:.3f}"),
                common.med_range(gtail, "{:.1f}"),
                common.med_range(reach, "{:.0f}"),
                common.med_range(final, "{:.2f}"),
                common.med_range(peak_to_end, "{:.2f}"),
                "-" if masked is None else common.med_range(masked, "{:.3f}"),
            ]
        )
    common.print_table(
        f"median (min-max) over {args.seeds} seeds",
        [
            "arm",
            "grad rel. variance (step 0)",
            "cos(batch grad, on-policy grad)",
            "grad norm, median",
            "grad norm p95 / median",
            f"steps to reward {args.level}",
            f"reward, last {tail} steps",
            "reward drop from peak",
            "masked token share",
        ],
        rows,
    )
    if args.png:
        fig, axes = common.figure(3, width=4.6, height=3.5)
        common.arm_bands(axes[0], runs, ARMS, "reward", LABELS, window=5)
        common.arm_bands(axes[1], runs, ARMS, "grad_norm", LABELS, window=3)
        axes[0].set(title="training reward (mismatched sampler)", xlabel="step", ylabel="5-step mean")
        axes[1].set(title="grad norm before clipping", xlabel="step", ylabel="3-step mean", yscale="log")
        axes[1].set_ylim(1e-2, 5)  # once every group is all right the gradient is 0: the curves leave the plot
        axes[0].legend(loc="upper left", fontsize=8)
        for i, arm in enumerate(ARMS):
            cosine = runs.extra[arm]["cos_median"]
            axes[2].scatter(np.full(len(cosine), i), cosine, color=common.COLORS[i], alpha=0.7)
            axes[2].hlines(np.median(cosine), i - 0.3, i + 0.3, color=common.COLORS[i], lw=2)
        axes[2].set_xticks(range(len(ARMS)), list(ARMS))
        axes[2].set(
            title="step 0: cos(batch gradient, on-policy gradient)\n(dots: seeds, bar: median)", ylim=(0, None)
        )
        title = (
            f"IcePop / KPop under sampler mismatch (noise p={args.mismatch_prob}, std={args.mismatch_std}); "
            f"median and min-max over {args.seeds} seeds"
        )
        common.save(fig, args.png, title)
    return summary


if __name__ == "__main__":
    common.quiet()
    main()
