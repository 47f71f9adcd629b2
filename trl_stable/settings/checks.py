"""Field checks shared by trl_stable's configuration classes (docs/reliability.md, "What is validated"): numbers in
range ([`Bound`] tables, [`check_bounds`]), no NaN or inf in any field ([`check_all_finite`]), and no setting made
without the option it needs ([`check_dependents`]), or, where TRL accepts such a setting (a drop-in takes every
`trl.GRPOConfig` TRL takes), a warning instead ([`IgnoredSettingWarning`], [`warn_ignored`]). It imports nothing
heavy, so the config modules stay light.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trl_stable.settings.secrets import redact


class IgnoredSettingWarning(UserWarning):
    """A setting the run ignores in this combination, accepted because TRL accepts it (a script written for
    `trl.GRPOTrainer` keeps running): the message names the field and what to do instead. Turn it into an error with
    ``warnings.simplefilter("error", IgnoredSettingWarning)``."""


@dataclass(frozen=True)
class Bound:
    """The valid values of one numeric field.

    Attributes:
        low, high: The bounds (None: unbounded on that side).
        low_open, high_open: Exclude the bound itself (``low < x`` rather than ``low <= x``).
        integer: The value must be an `int` (a `bool` is not one).
        optional: None is valid (the field's "off" or "automatic" value).
        fix: What to do instead, appended to the error (e.g. "use None to disable the early stop").
    """

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    optional: bool = False
    fix: str = ""

    def describe(self) -> str:
        """The rule in words, e.g. ``"an integer >= 1"`` or ``"None or a finite number in (0, 1]"``."""
        kind = "an integer" if self.integer else "a finite number"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            rule = f"{kind} in {left}{_num(self.low)}, {_num(self.high)}{right}"
        elif self.low is not None:
            rule = f"{kind} {'>' if self.low_open else '>='} {_num(self.low)}"
        elif self.high is not None:
            rule = f"{kind} {'<' if self.high_open else '<='} {_num(self.high)}"
        else:
            rule = kind
        return f"None or {rule}" if self.optional else rule

    def accepts(self, value: float) -> bool:
        """Whether a finite number `value` lies within the bounds."""
        above_low = self.low is None or (value > self.low if self.low_open else value >= self.low)
        return above_low and (self.high is None or (value < self.high if self.high_open else value <= self.high))


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _name(value: Any) -> str:
    """An enum's value (transformers' strategies and names) or the string itself."""
    return str(getattr(value, "value", value))


def check_bounds(config: Any, bounds: Mapping[str, Bound]) -> None:
    """Check each field of `config` named in `bounds` against its [`Bound`]: TypeError for a value that is not a number
    (or not an int where the bound wants one), ValueError for NaN, inf or out of range, naming the field, the valid
    values and the bound's fix."""
    for name, bound in bounds.items():
        value = getattr(config, name)
        if value is None and bound.optional:
            continue
        fix = f" {bound.fix}" if bound.fix else ""
        if not _is_number(value) or (bound.integer and not isinstance(value, numbers.Integral)):
            raise TypeError(f"{name}={value!r} ({type(value).__name__}) must be {bound.describe()}.{fix}")
        if not math.isfinite(value):
            raise ValueError(f"{name}={value} must be {bound.describe()}, not NaN or infinite.{fix}")
        if not bound.accepts(value):
            raise ValueError(f"{name}={value!r} must be {bound.describe()}.{fix}")


def check_all_finite(config: Any, allow_infinite: Iterable[str] = ()) -> None:
    """Refuse (ValueError, naming the field and the list entry) a NaN or infinite float in any dataclass field of
    `config`, in a list or tuple too (``reward_weights``); in `allow_infinite`, where +-inf means something, only
    NaN."""
    allow_infinite = set(allow_infinite)
    for f in dataclasses.fields(config):
        value = getattr(config, f.name, None)
        items = list(enumerate(value)) if isinstance(value, (list, tuple)) else [(None, value)]
        for index, item in items:
            if not _is_number(item) or isinstance(item, numbers.Integral) or math.isfinite(item):
                continue
            where = f.name if index is None else f"{f.name}[{index}]"
            if f.name not in allow_infinite:
                raise ValueError(
                    f"{where}={item} must be a finite number; a NaN or infinite setting is never meaningful."
                )
            if math.isnan(item):
                raise ValueError(f"{where} is NaN, which compares false with every number; use a number or +-inf.")


def option(default: Any, help: str) -> Any:  # noqa: A002 - the metadata key HfArgumentParser reads
    """A config field: ``field(default=default, metadata={"help": help})``, the flag and help text of the scripts."""
    return dataclasses.field(default=default, metadata={"help": help})


def field_default(config: Any, name: str) -> Any:
    """The default of dataclass field `name` of `config` (its default factory called), or `dataclasses.MISSING`."""
    f = type(config).__dataclass_fields__[name]
    # a field has a default, a default factory or neither (then `f.default` is MISSING), never both
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


@dataclass(frozen=True)
class Dependent:
    """Fields that only act when another option is on.

    Attributes:
        fields: The dependent fields. One counts as set when it is neither None nor its default.
        active: Whether the option they need is on (evaluated on the config).
        needs: The option in words, as the fix says it, e.g. ``"advantage_estimator='ngrpo'"``.
    """

    fields: tuple[str, ...]
    active: bool
    needs: str


def check_dependents(config: Any, dependents: Iterable[Dependent], warn: Callable[[str], None] | None = None) -> None:
    """Refuse (ValueError naming the fields set, the option they need and both fixes) a dependent field set while the
    option it needs is off, since the run would ignore it; with `warn` (e.g. ``logger.warning``) say it instead, for
    callers that set such fields on purpose before choosing the option."""
    for dep in dependents:
        if dep.active:
            continue
        values = {name: getattr(config, name) for name in dep.fields}
        set_fields = [name for name, v in values.items() if v is not None and v != field_default(config, name)]
        if set_fields:
            shown = ", ".join(f"{name}={redact(values[name])!r}" for name in set_fields)  # no URL key
            one = len(set_fields) == 1
            message = (
                f"{shown} only {'applies' if one else 'apply'} with {dep.needs}; without it the run would ignore "
                f"{'it' if one else 'them'}. Set {dep.needs}, or unset {', '.join(set_fields)}."
            )
            if warn is None:
                raise ValueError(message)
            warn(message)


def ignored_setting(message: str, stacklevel: int = 4) -> None:
    """`check_dependents`' `warn` for a combination TRL accepts: an [`IgnoredSettingWarning`] with `message`
    (`stacklevel` as `warnings.warn` counts it from here; the default suits a call through `check_dependents`)."""
    warnings.warn(message, IgnoredSettingWarning, stacklevel=stacklevel)


def warn_ignored(config: Any, ignored: Mapping[str, tuple[Any, str]], trainer: str) -> None:
    """Warn ([`IgnoredSettingWarning`]) about each field of `ignored` that is not at its accepted value.

    Args:
        ignored: field -> (the value the trainer takes without a word, why it has nothing to apply another one to).
        trainer: The trainer's name, as the message says it.
    """
    for name, (accepted, why) in ignored.items():
        value = getattr(config, name)
        if value != accepted and not (accepted == [] and not value):
            ignored_setting(f"{name}={value!r} is ignored by {trainer}: {why} Leave it at {accepted!r}.")


# The launchers' world-size variables (accelerate / torchrun, MPI): none of them set means a process started alone.
_WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


def check_ddp_backend(config: Any) -> None:
    """Refuse (ValueError naming the field and the fix) `ddp_backend` in a process started alone; call it before
    `TrainingArguments.__post_init__`, whose device set-up would fail on it with torch's "Default process group has
    not been initialized"."""
    sizes = [int(os.environ[key]) for key in _WORLD_SIZE_VARIABLES if os.environ.get(key)]
    if config.ddp_backend is not None and (sizes[0] if sizes else 1) <= 1:
        raise ValueError(
            f"ddp_backend={config.ddp_backend!r} sets the backend of a multi-process run, but this process was "
            "started alone (WORLD_SIZE unset): launch with `accelerate launch` / `torchrun`, or leave "
            "ddp_backend=None."
        )


def check_fp16_device(config: Any) -> None:
    """Refuse (ValueError naming the field and the fix) `fp16=True` on a CPU, where accelerate trains in float32
    without a word; call it after `TrainingArguments.__post_init__`, which resolves the device."""
    if config.fp16 and config.device.type == "cpu":
        raise ValueError(
            "fp16=True on a CPU would train in float32 without a word: accelerate runs float16 autocast and its "
            "loss scaler only on an accelerator (CUDA, XPU, ...). Use bf16=True (with use_cpu=True) on a CPU, or "
            "run on a GPU."
        )


# The `TrainingArguments` fields trl_stable's trainers read. transformers checks few of them (warmup_steps >= 0, a
# non-zero logging_steps), so a negative learning rate or a zero accumulation would otherwise train wrongly or fail
# with a ZeroDivisionError far from the setting.
TRAINING_ARGUMENT_BOUNDS: dict[str, Bound] = {
    "learning_rate": Bound(low=0.0),
    "weight_decay": Bound(low=0.0),
    "adam_beta1": Bound(low=0.0, high=1.0, high_open=True),
    "adam_beta2": Bound(low=0.0, high=1.0, high_open=True),
    "adam_epsilon": Bound(low=0.0),
    "max_grad_norm": Bound(low=0.0, optional=True, fix="0 (or None) disables gradient clipping."),
    "num_train_epochs": Bound(low=0.0),
    "max_steps": Bound(low=-1, integer=True, fix="-1 trains for num_train_epochs instead."),
    "gradient_accumulation_steps": Bound(low=1, integer=True, fix="Use 1 for no gradient accumulation."),
    "warmup_steps": Bound(low=0.0, fix="A value in [0, 1) is a fraction of the training steps."),
    "seed": Bound(low=0, high=2**32 - 1, integer=True),
}
_STEPS_BOUND = Bound(low=0.0, low_open=True, fix="A value in (0, 1) is a fraction of the training steps.")


def training_argument_bounds(config: Any) -> dict[str, Bound]:
    """[`TRAINING_ARGUMENT_BOUNDS`], plus `logging_steps` / `save_steps` when their strategy is "steps" (the only
    strategy that divides by them)."""
    bounds = dict(TRAINING_ARGUMENT_BOUNDS)
    for name, strategy in (("logging_steps", "logging_strategy"), ("save_steps", "save_strategy")):
        if _name(getattr(config, strategy)) == "steps":
            bounds[name] = _STEPS_BOUND
    return bounds


# The trackers whose transformers callback names its run after `run_name` (the others ignore it).
_RUN_NAMING_TRACKERS = ("comet_ml", "mlflow", "swanlab", "trackio", "wandb")
# Schedules that ignore `warmup_steps` / `lr_scheduler_kwargs` (transformers' `get_scheduler` passes neither on).
_NO_WARMUP_SCHEDULES = ("constant", "reduce_lr_on_plateau", "greedy")
_NO_KWARGS_SCHEDULES = ("constant", "constant_with_warmup")


def training_argument_dependents(config: Any) -> tuple[Dependent, ...]:
    """The `TrainingArguments` fields that only act together with another one, which `transformers.Trainer` ignores
    without a word otherwise (`warmup_steps` under "constant", `eval_steps` without step-wise evaluation, ...), as
    [`Dependent`]s for [`check_dependents`]; call it after `TrainingArguments.__post_init__` resolved the
    strategies."""
    schedule = _name(config.lr_scheduler_type)
    evaluates = _name(config.eval_strategy) != "no"
    report_to = set(config.report_to or [])
    seedable = getattr(getattr(config, "accelerator_config", None), "use_seedable_sampler", True)
    sampling = config.train_sampling_strategy
    return (
        Dependent(("num_train_epochs",), config.max_steps <= 0, "max_steps=-1 (max_steps > 0 sets the run's length)"),
        Dependent(
            ("warmup_steps",),
            schedule not in _NO_WARMUP_SCHEDULES,
            f"a schedule that warms up, e.g. lr_scheduler_type='constant_with_warmup' ({schedule!r} has no warm-up)",
        ),
        Dependent(
            ("lr_scheduler_kwargs",),
            schedule not in _NO_KWARGS_SCHEDULES,
            f"an lr_scheduler_type that takes arguments, e.g. 'cosine_with_min_lr' ({schedule!r} takes none)",
        ),
        Dependent(("logging_steps",), _name(config.logging_strategy) == "steps", "logging_strategy='steps'"),
        Dependent(("eval_steps",), _name(config.eval_strategy) == "steps", "eval_strategy='steps'"),
        Dependent(
            ("eval_delay", "metric_for_best_model", "greater_is_better"), evaluates, "eval_strategy='steps' or 'epoch'"
        ),
        Dependent(("save_steps",), _name(config.save_strategy) == "steps", "save_strategy='steps'"),
        Dependent(
            ("hub_strategy", "hub_always_push"), bool(config.push_to_hub), "push_to_hub=True (pushes while training)"
        ),
        Dependent(
            ("run_name",),
            bool(report_to & set(_RUN_NAMING_TRACKERS)),
            f"report_to naming a tracker that names its runs ({', '.join(_RUN_NAMING_TRACKERS)})",
        ),
        Dependent(
            ("project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id"),
            "trackio" in report_to,
            "report_to including 'trackio'",
        ),
        Dependent(
            ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"),
            bool(config.activation_checkpointing),
            "activation_checkpointing=True",
        ),
        Dependent(("fsdp_config",), bool(config.fsdp), "fsdp=True"),
        Dependent(
            ("dataloader_persistent_workers", "dataloader_multiprocessing_context", "dataloader_in_order"),
            config.dataloader_num_workers > 0,
            "dataloader_num_workers > 0 (they configure the loading workers)",
        ),
        Dependent(
            ("length_column_name",),
            sampling in ("group_by_length", "batch_rebalance"),
            "train_sampling_strategy='group_by_length'",
        ),
        Dependent(
            ("optim_target_modules",),
            _name(config.optim).startswith(("galore_", "apollo_")),
            "a GaLore or APOLLO optimizer (optim='galore_adamw', 'apollo_adamw', ...)",
        ),
        Dependent(
            ("data_seed",),
            (sampling == "random" and seedable) or sampling == "group_by_length",
            "a shuffling sampler: train_sampling_strategy='random' (with "
            "accelerator_config.use_seedable_sampler=True) or 'group_by_length'",
        ),
    )


def check_training_length(config: Any) -> None:
    """Refuse a run with no training step: ``max_steps <= 0`` (train for epochs) with ``num_train_epochs == 0``."""
    if config.max_steps <= 0 and config.num_train_epochs == 0:
        raise ValueError(
            f"max_steps={config.max_steps} and num_train_epochs={config.num_train_epochs}: the run has no training "
            "step. Set max_steps > 0 (steps) or num_train_epochs > 0 (passes over train_dataset)."
        )


# The bound on rewards times the summed weight magnitudes a config accepts: the weighted sum of bounded rewards, and
# the squares of its deviations over a batch, stay far inside float32 (3.4e38).
MAX_WEIGHTED_REWARD = 1e15


def check_reward_scale(config: Any) -> None:
    """Refuse `reward_weights` whose magnitudes, summed and times `max_abs_reward`, could overflow the weighted sum
    of bounded rewards (TRL's and PPO's aggregation) in float32; the error names the largest weight sum allowed."""
    limit, weights = config.max_abs_reward, config.reward_weights
    if limit is None or not weights:
        return
    total = sum(abs(float(w)) for w in weights)
    if total * limit > MAX_WEIGHTED_REWARD:
        raise ValueError(
            f"reward_weights={list(weights)} (summed magnitude {total:g}) times max_abs_reward={limit:g} exceeds "
            f"{MAX_WEIGHTED_REWARD:g}, where the weighted sum of rewards and its squares leave float32's range; use "
            f"weights whose magnitudes sum to at most {MAX_WEIGHTED_REWARD / limit:g} (rescale them), or a smaller "
            "max_abs_reward."
        )
