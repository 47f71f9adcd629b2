"""The alarm catalogue: for each alarm, the symptom, the likely cause and the remedy (the alarm table of
docs/health_monitoring.md)."""

from __future__ import annotations

from dataclasses import dataclass

WARNING = "warning"
CRITICAL = "critical"


@dataclass(frozen=True)
class AlarmSpec:
    """What an alarm means. `symptom` is a template filled with the measured `value`, the `threshold` and the
    `healthy` bound of the zero-std gauge."""

    name: str
    severity: str
    symptom: str
    cause: str
    remedy: str


# The alarms that corrupt the run rather than slow it (those `stop_after_critical_steps` acts on by default).
_CRITICAL = ("grad_norm_vanishing", "entropy_collapse", "nonfinite")

_TEXTS = {
    "zero_std": dict(
        symptom="{value:.0%} of the groups have zero reward variance "
        "(healthy < {healthy:.0%}, alarm > {threshold:.0%})",
        cause="every completion of a prompt gets the same reward, so group-normalised advantages are 0: "
        "the model has no learning signal (prompts too easy or too hard, or a reward too coarse)",
        remedy="inject virtual samples (NGRPO, advantage_estimator='ngrpo'), refine the reward (partial credit, "
        "dense rewards), or drop such groups with dynamic sampling",
    ),
    "reward_plateau": dict(
        symptom="reward/mean stuck at {value:.3f} below the declared maximum {threshold:.3f}",
        cause="the reward stopped rising short of its maximum: a perfect answer may not score the declared maximum, "
        "or the task is out of reach",
        remedy="check that a perfect answer scores exactly 1.0 (the reward cap); inspect the reward function on "
        "known-good answers; give partial credit or denser rewards",
    ),
    "reward_above_max": dict(
        symptom="reward/mean {value:.3f} exceeds the declared maximum {threshold:.3f}",
        cause="the reward functions return more than the declared maximum (weights not summing to 1, unscaled "
        "reward model)",
        remedy="rescale the rewards so that a perfect answer scores exactly the maximum (1.0), or declare the real "
        "maximum in health_reward_max",
    ),
    "grad_norm_vanishing": dict(
        symptom="grad_norm {value:.2e} stays near zero (floor {threshold:.2e})",
        cause="zero-variance groups (all advantages 0) or gradients of opposite sign cancelling",
        remedy="check frac_reward_zero_std; inject virtual samples (NGRPO) or refine the reward; check the loss is "
        "not fully masked by filters",
    ),
    "length_near_cap": dict(
        symptom="completion length {value:.1f} is near the cap {threshold:.0f}",
        cause="completions run into max_completion_length more than they did at the start of the run: the model "
        "loops or repeats itself",
        remedy="add an overlong penalty (DAPO soft punishment), mask truncated completions "
        "(mask_truncated_completions=True), or raise max_completion_length if answers are legitimately long",
    ),
    "entropy_collapse": dict(
        symptom="entropy {value:.3f} collapsed below {threshold:.3f}",
        cause="the policy became nearly deterministic: exploration is gone and rewards can only plateau",
        remedy="raise epsilon_high (clip-higher), lower the learning rate, raise the sampling temperature, add a KL "
        "or entropy term",
    ),
    "mismatch": dict(
        symptom="sampler vs trainer log-prob mean |diff| {value:.4f} > {threshold:.4f}",
        cause="the sampler and the trainer compute different probabilities for the same tokens: precision (fp8/int8 "
        "vs bf16/fp32), tokenizer or chat-template differences, MoE routing drift, left-padding positions (a model "
        "with absolute position embeddings, e.g. GPT-2, whose trainer forward numbers a left-padded row from its "
        "first column while the sampler numbers it from its first real token), or dropout left on in the trainer",
        remedy="use the same precision on both sides, check the tokenizer and re-tokenization, use routing replay "
        "on MoE models, derive position ids from the attention mask (trl_stable's GRPO does with use_decoupled_loss, "
        "capture_sampler_logps or health_mismatch_monitor; PPO always), set disable_dropout=True, and correct with "
        "the decoupled loss plus IcePop/KPop",
    ),
    "token_filter_masked": dict(
        symptom="IcePop/KPop mask {value:.1%} of the tokens (alarm > {threshold:.1%})",
        cause="many tokens have a behaviour weight outside the filter band: large sampler/trainer mismatch",
        remedy="check precision, tokenizer, MoE routing (routing replay), left-padding positions and dropout (see the "
        "mismatch alarm); the filters hide the problem but waste the masked samples",
    ),
    "retokenization": dict(
        symptom="{value:.0f} sample(s) re-tokenize to different ids than the sampler produced",
        cause="the trainer re-encodes the conversation (prompt, tool outputs, earlier turns) differently from the "
        "sampler: chat template, special tokens or decode/encode round trips",
        remedy="keep the sampler's token ids instead of re-encoding text, align the chat template, or drop the "
        "mismatching samples from the loss",
    ),
    "kl_above_target": dict(
        symptom="KL to the reference {value:.2f} stays above {threshold:.2f}",
        cause="the policy moves away from the reference faster than the KL penalty pulls it back: the KL "
        "coefficient is too small for this learning rate, or the adaptive controller too slow to catch up (its "
        "coefficient moves at most 20% x samples / horizon per step, a fraction of a percent with the default "
        "horizon of 10000), and the reward is being bought with KL (reward hacking, degenerate text)",
        remedy="raise init_kl_coef; use the adaptive KL controller (adap_kl_ctrl=True) with a shorter horizon so "
        "kl_coef can respond within the run; lower the learning rate (or ppo_epochs); read some samples for "
        "reward hacking",
    ),
    "nonfinite": dict(
        symptom="non-finite training value: {value}",
        cause="the update diverged (NaN/inf in loss or gradient): too high a learning rate, an exploding ratio, or "
        "NaN rewards",
        remedy="restore the last checkpoint, lower the learning rate, enable gradient clipping and the "
        "decoupled loss with IcePop; check the reward functions for NaN",
    ),
}
ALARMS: dict[str, AlarmSpec] = {
    name: AlarmSpec(name, CRITICAL if name in _CRITICAL else WARNING, **texts) for name, texts in _TEXTS.items()
}
