"""Configuration of trl_stable's GRPOTrainer: every field of `trl.GRPOConfig`, honoured, or refused (warned where
TRL accepts it: `ignored_settings`) by name, plus trl_stable's options (docs/grpo.md lists every field).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import trl

from trl_stable.core import NORMALIZATION_PRESETS
from trl_stable.core.estimators import is_sequence_level
from trl_stable.moe.hook import ROUTING_REPLAY_HELP, check_routing_replay_mode
from trl_stable.monitoring.callback import health_config_from_args
from trl_stable.monitoring.integration import HealthArguments
from trl_stable.rewards.dense import DEFAULT_MAX_ABS_REWARD
from trl_stable.settings.checks import (
    Bound,
    Dependent,
    check_all_finite,
    check_bounds,
    check_ddp_backend,
    check_dependents,
    check_fp16_device,
    check_reward_scale,
    check_training_length,
    option,
    training_argument_bounds,
)
from trl_stable.settings.secrets import SecretsNotPickled
from trl_stable.trainers.decoupled_args import DecoupledLossArguments
from trl_stable.trainers.grpo.ignored_settings import warn_ignored_settings
from trl_stable.trainers.step_mask_args import StepMaskArguments

# The presets TRL computes itself (its own config fields express them): the exact drop-in numbers.
_TRL_COMPUTED = ("grpo", "dr_grpo", "gdpo")
# TRL fields a preset sets, applied only while the field still has TRL's default (else it must already agree).
_PRESET_TRL_FIELDS = {
    "dr_grpo": {"scale_rewards": "none", "loss_type": "dr_grpo"},
    "gdpo": {"multi_objective_aggregation": "normalize_then_sum"},
}
_TRL_DEFAULTS = {"scale_rewards": "group", "loss_type": "dapo", "multi_objective_aggregation": "sum_then_normalize"}
_LEVEL_NAMES = {"batch": "batch", "group": "group", "none": None}
# The fine-grained fields that make trl_stable compute a preset itself (the first three: None keeps the preset).
_ADVANTAGE_OVERRIDES = (
    "advantage_mean_level",
    "advantage_std_level",
    "advantage_leave_one_out",
    "advantage_std_unbiased",
    "advantage_eps",
)

# The numeric fields trl_stable adds to `trl.GRPOConfig` and what is valid (the token filter's and the health
# monitor's check themselves; overlong_penalty_tokens <= max_completion_length is checked with the other options).
GRPO_BOUNDS: dict[str, Bound] = {
    "advantage_eps": Bound(low=0.0, optional=True, fix="None uses 1e-4 (1e-6 for 'ngrpo')."),
    "ngrpo_r_max": Bound(),
    "ngrpo_num_virtual": Bound(low=1, integer=True, fix="NGRPO adds at least one virtual sample per group."),
    "dynamic_sampling_max_refills": Bound(low=0, integer=True, fix="0 lets the batch shrink instead."),
    "overlong_penalty_tokens": Bound(low=1, integer=True, optional=True, fix="None disables the overlong penalty."),
    "overlong_penalty_factor": Bound(low=0.0, low_open=True),
    "dense_reward_coef": Bound(),
    "dense_reward_gamma": Bound(low=0.0, high=1.0, low_open=True),
    "max_abs_reward": Bound(low=0.0, low_open=True, optional=True, fix="None bounds only +-inf."),
    "reward_max_failing_steps": Bound(low=1, integer=True, optional=True, fix="None never stops."),
    "health_reward_max": Bound(optional=True, fix="None declares no maximum."),
}
# TRL's own sampling, batch and loss numbers, which `trl.GRPOConfig` does not check (a top_p of 1.5 or a zero
# temperature reaches `generate`; num_generations=0 divides by zero). Refusing them changes no valid run.
TRL_GRPO_BOUNDS: dict[str, Bound] = {
    "per_device_train_batch_size": Bound(low=1, integer=True),
    "num_generations": Bound(low=2, integer=True, fix="GRPO compares completions of the same prompt."),
    "num_generations_eval": Bound(low=1, integer=True, optional=True, fix="None uses num_generations."),
    "max_completion_length": Bound(low=1, integer=True, optional=True),
    "generation_batch_size": Bound(low=1, integer=True, optional=True, fix="None derives it from the batch size."),
    "steps_per_generation": Bound(low=1, integer=True, optional=True, fix="None uses gradient_accumulation_steps."),
    "temperature": Bound(low=0.0, low_open=True),
    "top_p": Bound(low=0.0, high=1.0, low_open=True, fix="1.0 turns nucleus sampling off."),
    "top_k": Bound(low=0, integer=True, optional=True, fix="0 turns top-k off."),
    "min_p": Bound(low=0.0, high=1.0, optional=True, fix="None turns min-p off."),
    "repetition_penalty": Bound(low=0.0, low_open=True, fix="1.0 turns the penalty off."),
    "beta": Bound(low=0.0, fix="0 turns the KL term off."),
    "num_iterations": Bound(low=1, integer=True),
    "epsilon": Bound(low=0.0, low_open=True),
    "epsilon_high": Bound(low=0.0, low_open=True, optional=True, fix="None uses epsilon."),
    "delta": Bound(low=1.0, low_open=True, optional=True, fix="None turns the two-sided clip off."),
    "top_entropy_quantile": Bound(low=0.0, high=1.0, low_open=True, fix="1.0 trains on every token."),
    "ref_model_mixup_alpha": Bound(low=0.0, high=1.0),
    "ref_model_sync_steps": Bound(low=1, integer=True),
    "sapo_temperature_neg": Bound(low=0.0, low_open=True),
    "sapo_temperature_pos": Bound(low=0.0, low_open=True),
    "vllm_importance_sampling_clip_min": Bound(low=0.0, optional=True),
    "vllm_importance_sampling_clip_max": Bound(low=0.0, low_open=True, optional=True),
    "off_policy_mask_threshold": Bound(low=0.0, optional=True, fix="None turns the off-policy mask off."),
}


@dataclass
class GRPOConfig(SecretsNotPickled, trl.GRPOConfig, HealthArguments, DecoupledLossArguments, StepMaskArguments):
    r"""Configuration for [`GRPOTrainer`]: every field of `trl.GRPOConfig`, plus trl_stable's options, each off by
    default (identical to `trl.GRPOTrainer`; the health monitor only reads the logs). docs/grpo.md has the table."""

    advantage_estimator: str = option(
        "grpo",
        "Advantage estimator preset: 'grpo' (TRL default), 'dr_grpo', 'liteppo', 'rloo', 'gdpo' or "
        "'ngrpo'. Presets set the TRL fields they need (dr_grpo: scale_rewards='none', loss_type='dr_grpo'; "
        "gdpo: multi_objective_aggregation='normalize_then_sum').",
    )
    advantage_mean_level: str | None = option(
        None, "Override the preset's mean level: 'batch', 'group' or 'none'. None keeps the preset."
    )
    advantage_std_level: str | None = option(
        None, "Override the preset's std level: 'batch', 'group' or 'none'. None keeps the preset."
    )
    advantage_leave_one_out: bool | None = option(
        None, "Override the preset's leave-one-out mean (RLOO baseline). None keeps the preset."
    )
    advantage_std_unbiased: bool = option(True, "Use the unbiased (n - 1) std in trl_stable's advantage estimators.")
    advantage_eps: float | None = option(
        None,
        "Added to the std when dividing. None: 1e-4 (TRL's value), 1e-6 for 'ngrpo'. Set with 'grpo' (as "
        "is advantage_std_unbiased=False), trl_stable computes the group/group advantages itself; not for 'gdpo'.",
    )
    ngrpo_r_max: float = option(1.0, "NGRPO: reward of the virtual samples (the best achievable reward).")
    ngrpo_num_virtual: int = option(1, "NGRPO: number of virtual samples per group (>= 1).")
    use_decoupled_loss: bool = option(
        False,
        "Decoupled PPO loss (AReaL): clip against proximal log-probs recomputed before the update, "
        "times the behaviour weight exp(logp_prox - logp_sampler). With HF generation the sampler's log-probs "
        "are recorded during generation.",
    )
    # token_filter, token_filter_level/_action/_lower/_upper: from DecoupledLossArguments
    capture_sampler_logps: bool = option(
        False,
        "Record the HF sampler's per-token log-probs (as `sampling_per_token_logps`) even without the "
        "decoupled loss, e.g. for mismatch monitoring.",
    )
    dynamic_sampling: bool = option(
        False,
        "DAPO dynamic sampling: drop groups whose rewards are all equal from the loss and its token normalisation.",
    )
    dynamic_sampling_max_refills: int = option(
        0,
        "With dynamic_sampling: extra generation rounds (new random prompts) that refill the batch with "
        "informative groups so it keeps its size, as DAPO does. 0: the batch shrinks instead (dropped groups are "
        "only masked). Map-style train datasets only.",
    )
    overlong_penalty_tokens: int | None = option(
        None,
        "DAPO overlong penalty: the buffer (tokens) before max_completion_length where the penalty ramps "
        "from 0 to -overlong_penalty_factor. None disables it.",
    )
    overlong_penalty_factor: float = option(1.0, "DAPO overlong penalty at max_completion_length (a positive number).")
    dense_reward_coef: float = option(
        1.0, "Coefficient of the dense reward-to-go added to the sequence advantage (dense rewards only)."
    )
    dense_reward_gamma: float = option(1.0, "Discount of the dense reward-to-go, in (0, 1].")
    nan_reward_action: str = option(
        "zero",
        "A completion that every reward function scored None/NaN/inf: 'zero' keeps TRL's behavior "
        "(advantage 0, outside the group baseline, still counted in the loss's token normalizer); 'drop' "
        "(recommended) removes it from the loss with a warning and the `rewards/nan_dropped` counter (a batch "
        "with no scorable completion raises).",
    )
    reward_max_failing_steps: int | None = option(
        5,
        "Stop training when a reward function fails on every completion (it raises, or gives None/NaN or "
        "an out-of-range value for all of them) this many steps in a row; each such step warns, naming the "
        "function and the cause, and its completions are unscored (nan_reward_action). None: never stop.",
    )
    max_abs_reward: float | None = option(
        DEFAULT_MAX_ABS_REWARD,
        "The largest reward magnitude taken: a reward (sequence value, reward-model logit, dense token) "
        "beyond +-max_abs_reward is treated as NaN (does not apply; nan_reward_action), with a warning and "
        "`rewards/<name>/out_of_range` (logged on the steps where it happens), so the float32 arithmetic stays "
        "finite (a 1e20 reward gave inf losses). None: only +-inf. Runs whose rewards stay within the bound are "
        "TRL's, number for number.",
    )
    # step_loss_mask, step_mask_tools: from StepMaskArguments
    routing_replay: str = option("off", ROUTING_REPLAY_HELP)

    def __post_init__(self):
        # Before TRL's own checks, which divide by some of these (num_generations=0 would be a ZeroDivisionError).
        check_bounds(self, {**training_argument_bounds(self), **TRL_GRPO_BOUNDS, **GRPO_BOUNDS})
        check_ddp_backend(self)  # before transformers' device set-up, which fails on it without naming it
        super().__post_init__()
        check_fp16_device(self)
        self._validate()
        warn_ignored_settings(self)

    def _validate(self) -> None:
        """trl_stable's checks, after TRL's own: `__post_init__` runs them, and `with_changes` on a changed copy."""
        check_all_finite(self)
        check_training_length(self)
        check_reward_scale(self)
        check_routing_replay_mode(self.routing_replay)
        self.validate_step_mask_arguments()
        if not is_sequence_level(self.advantage_estimator):
            raise ValueError(
                f"advantage_estimator={self.advantage_estimator!r} is unknown; use one of 'grpo', 'dr_grpo', "
                "'liteppo', 'rloo', 'gdpo', 'ngrpo' or a sequence-level estimator registered with "
                "`trl_stable.core.estimators.register_advantage_estimator`."
            )
        for name in ("advantage_mean_level", "advantage_std_level"):
            value = getattr(self, name)
            if value is not None and value not in _LEVEL_NAMES:
                raise ValueError(f"{name}={value!r} is invalid; use 'batch', 'group', 'none' or None (preset).")
        fine = [name for name in _ADVANTAGE_OVERRIDES[:3] if getattr(self, name) is not None]
        if fine and self.advantage_estimator not in NORMALIZATION_PRESETS:
            raise ValueError(
                f"{', '.join(fine)} cannot be combined with advantage_estimator={self.advantage_estimator!r}, which "
                "has its own normalization; unset them or pick 'grpo'/'dr_grpo'/'liteppo'/'rloo'."
            )
        if self.advantage_leave_one_out and self.advantage_mean_level == "none":
            raise ValueError(
                "advantage_leave_one_out=True needs a mean: set advantage_mean_level='group' (RLOO) or 'batch'."
            )
        fixed = {"gdpo": ("advantage_eps", "advantage_std_unbiased"), "ngrpo": ("advantage_std_unbiased",)}
        for name in fixed.get(self.advantage_estimator, ()):
            if getattr(self, name) != _STABLE_DEFAULTS[name]:
                raise ValueError(
                    f"{name} does not apply to advantage_estimator={self.advantage_estimator!r}, whose std is fixed "
                    f"(unbiased{', eps 1e-4 as in TRL' if self.advantage_estimator == 'gdpo' else ''}); unset {name}."
                )
        if self.scale_rewards != _TRL_DEFAULTS["scale_rewards"] and self.advantage_estimator != "dr_grpo":
            if self.advantage_estimator != "grpo" or self._own_normalization_requested():
                raise ValueError(
                    f"scale_rewards={self.scale_rewards!r} is TRL's own advantage scaling, which trl_stable replaces "
                    f"for advantage_estimator={self.advantage_estimator!r} and the advantage_* overrides; unset "
                    "scale_rewards and choose the std with advantage_std_level ('batch', 'group' or 'none')."
                )
        if self.multi_objective_aggregation == "normalize_then_sum" and self.advantage_estimator != "gdpo":
            if self.advantage_estimator != "grpo" or self._own_normalization_requested():
                raise ValueError(
                    "multi_objective_aggregation='normalize_then_sum' is GDPO's per-reward normalization and cannot "
                    f"be combined with advantage_estimator={self.advantage_estimator!r} or the advantage_* overrides; "
                    "use advantage_estimator='gdpo' alone."
                )
        for trl_field, wanted in _PRESET_TRL_FIELDS.get(self.advantage_estimator, {}).items():
            current = getattr(self, trl_field)
            if current == _TRL_DEFAULTS[trl_field]:
                setattr(self, trl_field, wanted)
            elif current != wanted and not (trl_field == "loss_type"):
                raise ValueError(
                    f"advantage_estimator={self.advantage_estimator!r} needs {trl_field}={wanted!r}, but "
                    f"{trl_field}={current!r} was set; unset {trl_field} or choose another estimator."
                )

        generate_every = self.steps_per_generation * self.num_iterations
        old_logprob_pass = self.gradient_accumulation_steps % generate_every != 0 or (
            self.use_vllm and self.vllm_importance_sampling_correction
        )
        if self.routing_replay == "R2" and not (old_logprob_pass or self.use_decoupled_loss):
            raise ValueError(
                "routing_replay='R2' records the routing in the old-logprob pass, which this configuration never runs "
                "(one update per generation batch: TRL skips the pass, the ratio being exactly 1), so the run would "
                "ignore it. Set num_iterations > 1 (or steps_per_generation > gradient_accumulation_steps, or "
                "use_decoupled_loss=True), use routing_replay='R3' (the sampler's routing), or unset routing_replay."
            )

        # Decoupled loss and token filters
        if self.use_decoupled_loss and self.loss_type == "sapo":
            raise ValueError(
                "loss_type='sapo' and use_decoupled_loss=True are mutually exclusive (SAPO's soft gate replaces the "
                "clipped term the decoupled loss reweights); set use_decoupled_loss=False or another loss_type."
            )
        if self.use_decoupled_loss and self.loss_type == "vespo":
            raise ValueError(
                "loss_type='vespo' weighs sequences by its own importance ratio and cannot take the decoupled "
                "loss's behaviour weight; set use_decoupled_loss=False or another loss_type."
            )
        if self.use_decoupled_loss and self.use_vllm and self.vllm_importance_sampling_correction:
            raise ValueError(
                "use_decoupled_loss=True already applies the behaviour weight exp(logp_prox - logp_sampler); with "
                "vllm_importance_sampling_correction=True it would be applied twice. Set "
                "vllm_importance_sampling_correction=False."
            )
        if self.use_decoupled_loss and self.use_transformers_continuous_batching:
            raise ValueError(
                "use_decoupled_loss=True needs the sampler's log-probs, which transformers' continuous batching does "
                "not return; set use_transformers_continuous_batching=False (or use vLLM)."
            )
        self.validate_decoupled_loss_arguments()

        # Rewards
        if self.overlong_penalty_tokens is not None and self.overlong_penalty_tokens > self.max_completion_length:
            raise ValueError(
                f"overlong_penalty_tokens={self.overlong_penalty_tokens} must be in [1, max_completion_length="
                f"{self.max_completion_length}]."
            )
        if self.nan_reward_action not in ("drop", "zero"):
            raise ValueError(f"nan_reward_action={self.nan_reward_action!r} is invalid; use 'drop' or 'zero'.")
        check_dependents(
            self,
            (
                Dependent(
                    ("ngrpo_r_max", "ngrpo_num_virtual"),
                    self.advantage_estimator == "ngrpo" or self.health_remedy_virtual_samples,
                    "advantage_estimator='ngrpo' (or health_remedy_virtual_samples=True, which switches to it)",
                ),
                Dependent(
                    ("overlong_penalty_factor",),
                    self.overlong_penalty_tokens is not None,
                    "overlong_penalty_tokens set (the penalty's ramp, in tokens)",
                ),
                Dependent(("dynamic_sampling_max_refills",), self.dynamic_sampling, "dynamic_sampling=True"),
                Dependent(
                    ("capture_sampler_logps",),
                    not (self.use_vllm or self.use_transformers_continuous_batching),
                    "HF generation (use_vllm=False, use_transformers_continuous_batching=False; vLLM returns the "
                    "sampler's log-probs itself)",
                ),
                Dependent(
                    ("advantage_std_unbiased",),
                    self.advantage_estimator in NORMALIZATION_PRESETS and self._divides_by_std(),
                    "an advantage std (advantage_estimator 'grpo' or 'liteppo', or advantage_std_level='group' / "
                    "'batch')",
                ),
                Dependent(
                    ("advantage_eps",),
                    self.advantage_estimator not in NORMALIZATION_PRESETS or self._divides_by_std(),
                    "an advantage std (advantage_estimator 'grpo', 'liteppo' or 'ngrpo', or advantage_std_level="
                    "'group' / 'batch')",
                ),
                Dependent(
                    ("health_mismatch_monitor",),
                    not self.use_transformers_continuous_batching or self.use_vllm,
                    "HF generation or vLLM (transformers' continuous batching returns no sampler log-probs)",
                ),
                Dependent(
                    ("health_mismatch_threshold",),
                    self.health_mismatch_monitor
                    or self.use_decoupled_loss
                    or self.use_vllm
                    or self.capture_sampler_logps,
                    "a mismatch to watch: health_mismatch_monitor=True (or use_decoupled_loss / use_vllm, which log "
                    "mismatch/* themselves)",
                ),
            ),
        )
        self.validate_health_arguments()
        self.virtual_samples_config()  # the remedy's configuration is validated now, not first mid-run

    def _divides_by_std(self) -> bool:
        """Whether a normalization preset (after the advantage_std_level override) divides by a std."""
        preset = NORMALIZATION_PRESETS.get(self.advantage_estimator, {})
        level = self.advantage_std_level
        return (preset.get("std_level") if level is None else _LEVEL_NAMES[level]) is not None

    def _own_normalization_requested(self) -> bool:
        """Whether a fine-grained advantage_* field asks trl_stable to compute a 'grpo'/'dr_grpo' normalization."""
        return any(getattr(self, name) != _STABLE_DEFAULTS[name] for name in _ADVANTAGE_OVERRIDES)

    def with_changes(self, **changes: Any) -> GRPOConfig:
        """A validated copy with `changes` to trl_stable's own fields (TRL's need a new `GRPOConfig`: its
        `__post_init__` sets accelerate's devices up again)."""
        others = sorted(set(changes) - set(_STABLE_DEFAULTS))
        if others:
            raise ValueError(
                f"with_changes sets trl_stable's own GRPOConfig fields only, not {others}: build a new GRPOConfig "
                "(before the trainer) to change them."
            )
        changed = copy.copy(self)
        vars(changed).update(changes)
        check_bounds(changed, {name: GRPO_BOUNDS[name] for name in changes if name in GRPO_BOUNDS})
        changed._validate()
        return changed

    def virtual_samples_config(self) -> GRPOConfig | None:
        """The configuration the virtual-samples remedy trains with while the zero-std alarm holds (this one with
        ``virtual_samples_attr`` set to ``virtual_samples_value``, via `with_changes`), or None without the remedy;
        ValueError naming the remedy and the fix when that change is not a field, changes nothing or is refused."""
        health = health_config_from_args(self)
        if health is None or not health.remedy_virtual_samples:
            return None
        attr, value = health.virtual_samples_attr, health.virtual_samples_value
        remedy = f"health_remedy_virtual_samples=True trains with {attr}={value!r} while the zero-std alarm holds"
        if attr not in _STABLE_DEFAULTS:
            raise ValueError(
                f"{remedy}, but {attr!r} is not one of trl_stable's GRPOConfig fields, which the remedy can switch; "
                "set virtual_samples_attr to one (the default, 'advantage_estimator')."
            )
        if getattr(self, attr) == value:
            raise ValueError(f"{remedy}, which this configuration already has, so it changes nothing; unset it.")
        health_kwargs = {k: v for k, v in (self.health_monitor_kwargs or {}).items() if k != "remedy_virtual_samples"}
        try:  # the copy is the configuration in force while the remedy is on: the remedy itself is not part of it
            return self.with_changes(
                **{attr: value, "health_remedy_virtual_samples": False, "health_monitor_kwargs": health_kwargs or None}
            )
        except ValueError as err:
            raise ValueError(
                f"{remedy}, and this configuration refuses {attr}={value!r}: {err} Make {attr}={value!r} valid with "
                "the other settings, or unset health_remedy_virtual_samples."
            ) from err

    @property
    def advantage_settings(self) -> dict[str, Any] | None:
        """The registered estimator trl_stable computes the advantages with, ``{"estimator": name, **params}``;
        None when TRL computes them ('grpo', 'dr_grpo', 'gdpo' without an advantage_* override: TRL's numbers)."""
        name = self.advantage_estimator
        if name in _TRL_COMPUTED and not self._own_normalization_requested():
            return None
        if name == "ngrpo":
            eps = 1e-6 if self.advantage_eps is None else self.advantage_eps
            return {"estimator": name, "r_max": self.ngrpo_r_max, "num_virtual": self.ngrpo_num_virtual, "eps": eps}
        if name not in NORMALIZATION_PRESETS:  # a user-registered estimator: its own defaults
            return {"estimator": name, **({} if self.advantage_eps is None else {"eps": self.advantage_eps})}
        settings = dict(NORMALIZATION_PRESETS[name])
        for key in ("mean_level", "std_level"):
            if (level := getattr(self, f"advantage_{key}")) is not None:
                settings[key] = _LEVEL_NAMES[level]
        if self.advantage_leave_one_out is not None:
            settings["leave_one_out"] = self.advantage_leave_one_out
        eps = 1e-4 if self.advantage_eps is None else self.advantage_eps
        return {"estimator": name, **settings, "unbiased": self.advantage_std_unbiased, "eps": eps}


# Defaults of the trl_stable fields, for a trainer given a plain `trl.GRPOConfig`.
_STABLE_DEFAULTS = {
    name: f.default
    for name, f in GRPOConfig.__dataclass_fields__.items()
    if name not in trl.GRPOConfig.__dataclass_fields__
}
