"""The health rules (docs/health_monitoring.md) as a framework-free tracker: one log record in, alarm events out."""

from __future__ import annotations

import math
import re
import statistics
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from trl_stable.monitoring.alarms import ALARMS, CRITICAL
from trl_stable.monitoring.metric_names import MASKED_FRACTION_KEYS
from trl_stable.settings.checks import option

__all__ = [
    "DEFAULT_METRIC_KEYS",
    "HealthConfig",
    "HealthEvent",
    "HealthTracker",
    "extract_gauges",
    "floor_from_reference",
]

# gauge -> log keys that may carry it, first present wins. TRL GRPO names first, then trl_stable PPO names.
DEFAULT_METRIC_KEYS: dict[str, tuple[str, ...]] = {
    "reward": ("reward", "env/reward_mean", "objective/scores"),
    "frac_reward_zero_std": ("frac_reward_zero_std",),
    "grad_norm": ("grad_norm", "policy/grad_norm"),
    "loss": ("loss", "loss/total"),
    "completion_length": ("completions/mean_length", "tokens/response_len_mean"),
    "clipped_ratio": ("completions/clipped_ratio", "tokens/truncated_frac"),
    # per-token entropy first: PPO's `objective/entropy` is summed over a response, so it shrinks with the length
    "entropy": ("entropy", "policy/entropy", "objective/entropy"),
    "mismatch": ("mismatch/logp_abs_diff/mean", "sampling/sampling_logp_difference/mean"),
    "mismatch_max": ("mismatch/logp_abs_diff/max", "sampling/sampling_logp_difference/max"),
    "mismatch_outside_band": ("mismatch/ratio/outside_band",),
    "retokenization": ("retokenization/mismatched",),
    # both trainers' names (`token_filter/<filter>/masked_token_frac`, ...); the gauge is their maximum
    "masked_fraction": MASKED_FRACTION_KEYS,
    # KL to the reference: PPO's sequence KL first (the unit of its `target`), then TRL GRPO's per-token mean
    "kl": ("objective/kl", "kl"),
    "kl_coef": ("objective/kl_coef",),
    "value_loss": ("loss/value",),
}
# Filter shares logged under other names (custom loops, other frameworks' keys such as `kpop/masked_frac`). Sequence
# shares are left out: with a token-level filter one masked token marks a whole sequence.
MASKED_FRACTION_PATTERN = r"^(?!eval_)(?!.*seq)(?=.*(icepop|kpop))(?=.*(mask|clamp|filter|drop)).*(frac|ratio|share)"

GAUGES = tuple(DEFAULT_METRIC_KEYS)
# Gauges judged against the run's own start (the median of their first `reference_window` values).
_REFERENCE_GAUGES = ("grad_norm", "entropy", "completion_length", "clipped_ratio")


@dataclass
class HealthConfig:
    """Thresholds, debouncing and remedies of the health monitor (the alarm table of docs/health_monitoring.md).

    Windows and patience count log records (one per `logging_steps`).
    """

    zero_std_healthy: float = option(0.3, "frac_reward_zero_std below this is healthy.")
    zero_std_alarm: float = option(0.5, "Alarm when frac_reward_zero_std exceeds this.")
    reward_max: float | None = option(1.0, "Declared maximum reward; None disables the plateau and above-max alarms.")
    # A noisy reward (std ~0.06 per record) that rises ~0.08 per 25 records is told apart from a flat one
    # only over ~50 records; a window of 20 raised the alarm on such healthy runs.
    plateau_window: int = option(50, "Log records over which the reward trend is measured for plateau detection.")
    plateau_min_rise: float = option(
        0.01, "Plateau when the window's second half rises less than this over its first."
    )
    ceiling_margin: float = option(0.05, "A flat reward this close to reward_max is converged, not a plateau.")
    reference_window: int = option(5, "First finite values of a relative gauge whose median is its reference.")
    grad_norm_floor: float = option(1e-6, "grad_norm below this is 'near zero'.")
    grad_norm_relative_floor: float = option(0.01, "grad_norm below this fraction of its reference is near zero.")
    max_completion_length: int | None = option(
        None, "Completion cap; None: from the trainer arguments (max_completion_length, ...)."
    )
    length_cap_ratio: float = option(0.9, "Alarm when the mean length reaches this fraction of the cap from below.")
    clipped_ratio_alarm: float = option(0.3, "Alarm when the truncated share rises this much above its reference.")
    entropy_floor: float = option(
        0.05, "Entropy (nats/token) below this (or half its reference, if lower) has collapsed."
    )
    entropy_relative_floor: float = option(0.1, "Entropy below this fraction of its reference has collapsed.")
    mismatch_threshold: float = option(0.01, "Alarm when the mean |logp_sampler - logp_trainer| exceeds this.")
    mismatch_band: tuple[float, float] = option((0.9, 1.1), "Healthy band of the token ratio pi_trainer / pi_sampler.")
    masked_fraction_alarm: float = option(0.1, "Alarm when IcePop/KPop mask more than this share of tokens.")
    kl_target: float | None = option(
        None, "KL target in the KL gauge's unit; None: PPOConfig's `target`, else the alarm is off."
    )
    kl_alarm_ratio: float = option(2.0, "Alarm when the KL to the reference stays above this multiple of kl_target.")
    kl_patience: int = option(5, "Consecutive log records above kl_alarm_ratio x kl_target to raise the alarm.")
    patience: int = option(3, "Consecutive log records a condition must hold before its alarm is raised.")
    clear_patience: int = option(3, "Consecutive healthy log records before a raised alarm is cleared.")
    repeat_every: int = option(50, "While an alarm holds, repeat it every this-many log records (0: never).")
    disabled_alarms: list[str] = field(
        default_factory=list, metadata={"help": f"Alarms to switch off, among {sorted(ALARMS)}."}
    )
    critical_alarms: list[str] | None = option(
        None, "Alarms critical for stop_after_critical_steps; None: the catalogue's."
    )
    metric_keys: dict[str, list[str]] | None = option(
        None, f"Log keys of a gauge among {GAUGES}, e.g. {{'reward': ['my/reward']}}."
    )
    remedy_virtual_samples: bool = option(False, "While the zero_std alarm holds, train with NGRPO virtual samples.")
    virtual_samples_attr: str = option(
        "advantage_estimator", "Trainer-argument attribute the virtual-samples remedy sets."
    )
    virtual_samples_value: Any = option("ngrpo", "Value that switches NGRPO virtual samples on.")
    stop_after_critical_steps: int | None = option(
        None, "Save and stop once a critical alarm has held this many steps; None: never stop."
    )
    health_file: str | None = option(
        "health.jsonl", "JSON Lines file in output_dir receiving the gauges and alarm events; None: no file."
    )
    log_to_history: bool = option(
        True, "Add `health/*` flags to the trainer's logs (log history, wandb, tensorboard)."
    )
    dashboard_on_train_end: bool = option(False, "Render `health_dashboard.png` into output_dir when training ends.")

    def __post_init__(self):
        if not 0 <= self.zero_std_healthy <= self.zero_std_alarm <= 1:
            raise ValueError(
                f"Need 0 <= zero_std_healthy <= zero_std_alarm <= 1, got zero_std_healthy={self.zero_std_healthy}, "
                f"zero_std_alarm={self.zero_std_alarm}."
            )
        ranges = {  # bound -> the fields it applies to
            ">= 1": ("plateau_window", "reference_window", "patience", "clear_patience", "kl_patience"),
            ">= 0": ("grad_norm_floor", "entropy_floor", "mismatch_threshold", "plateau_min_rise", "ceiling_margin"),
            "in [0, 1]": ("grad_norm_relative_floor", "entropy_relative_floor", "length_cap_ratio")
            + ("clipped_ratio_alarm", "masked_fraction_alarm"),
        }
        for bound, names in ranges.items():
            for name in names:
                value = getattr(self, name)
                if value < (1 if bound == ">= 1" else 0) or (bound == "in [0, 1]" and value > 1):
                    raise ValueError(f"{name} must be {bound}, got {value}.")
        if self.plateau_window < 4:
            raise ValueError(f"plateau_window must be >= 4 to compare two halves, got {self.plateau_window}.")
        if self.repeat_every < 0:
            raise ValueError(f"repeat_every must be >= 0 (0 disables repeats), got {self.repeat_every}.")
        if self.kl_target is not None and not (math.isfinite(self.kl_target) and self.kl_target > 0):
            raise ValueError(f"kl_target must be a finite number > 0 or None (the trainer's), got {self.kl_target}.")
        if not (math.isfinite(self.kl_alarm_ratio) and self.kl_alarm_ratio >= 1):
            raise ValueError(f"kl_alarm_ratio must be a finite multiple >= 1 of kl_target, got {self.kl_alarm_ratio}.")
        self.mismatch_band = tuple(self.mismatch_band)
        if len(self.mismatch_band) != 2 or not 0 < self.mismatch_band[0] < 1 < self.mismatch_band[1]:
            raise ValueError(f"mismatch_band must be (low, high) with 0 < low < 1 < high, got {self.mismatch_band}.")
        for name, off in (("max_completion_length", ""), ("stop_after_critical_steps", " (never stop)")):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None{off}, got {getattr(self, name)}.")
        names = (("disabled_alarms", "alarms", sorted(ALARMS)), ("critical_alarms", "alarms", sorted(ALARMS)))
        for name, kind, known in (*names, ("metric_keys", "gauges", list(GAUGES))):
            unknown = sorted(set(getattr(self, name) or ()) - set(known))
            if unknown:
                raise ValueError(f"{name} has unknown {kind} {unknown}; known: {known}.")
        if self.remedy_virtual_samples and not self.virtual_samples_attr:
            raise ValueError("remedy_virtual_samples needs virtual_samples_attr (the trainer-argument to set).")

    @property
    def critical(self) -> set[str]:
        if self.critical_alarms is not None:
            return set(self.critical_alarms)
        return {name for name, spec in ALARMS.items() if spec.severity == CRITICAL}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class HealthEvent:
    """One alarm event. `kind` is "raised", "repeated" or "cleared"."""

    step: int
    kind: str
    alarm: str
    severity: str
    value: float | None
    threshold: float | None
    symptom: str
    cause: str
    remedy: str
    since: int | None = None

    def to_record(self) -> dict[str, Any]:
        return {key: json_number(value) for key, value in {"type": "alarm", **asdict(self)}.items()}

    def message(self) -> str:
        if self.kind == "cleared":
            return f"[health] step {self.step}: {self.alarm} cleared"
        if self.kind == "repeated":  # the cause and remedy were given when it was raised
            return f"[health] step {self.step}: {self.alarm} still holds (since step {self.since}): {self.symptom}"
        return (
            f"[health] step {self.step}: {self.severity.upper()} {self.alarm}: {self.symptom}. "
            f"Likely cause: {self.cause}. Remedy: {self.remedy}."
        )


def json_number(value: Any) -> Any:
    """`value` as strict JSON allows it: NaN/inf become their string ("nan", "inf"), anything else is unchanged."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def floor_from_reference(reference: float | None, absolute: float, relative: float) -> float:
    """The "near zero" floor of a gauge whose typical size is `reference` (median of its first values; None while
    unknown): `absolute`, raised to `relative * reference`, and never above half the reference, so a run that starts
    small (a confident model's entropy) is judged by how far it falls, not by where it starts."""
    return absolute if reference is None else max(relative * reference, min(absolute, 0.5 * reference))


def _finite_float(value: Any) -> float | None:
    """A log value as float; None when absent or not a number. NaN/inf are kept (the nonfinite alarm needs them)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def extract_gauges(logs: Mapping[str, Any], metric_keys: Mapping[str, Iterable[str]] | None = None) -> dict:
    """Read the gauges from one log record (a `Trainer.log` dict or a log-history entry).

    Returns a dict gauge -> float for the gauges present; `masked_fraction` is the largest IcePop/KPop masked share
    (its keys plus, unless overridden in `metric_keys`, every key matching `MASKED_FRACTION_PATTERN`).
    """
    metric_keys = metric_keys or {}
    keys = {**DEFAULT_METRIC_KEYS, **{k: tuple(v) for k, v in metric_keys.items()}}
    masked_keys = list(keys.pop("masked_fraction"))  # the gauge is their maximum, added last
    if "masked_fraction" not in metric_keys:
        masked_keys += [k for k in logs if re.search(MASKED_FRACTION_PATTERN, str(k), re.IGNORECASE)]

    def numbers(names: Iterable[str]) -> Iterator[float]:  # the values logged under `names` that are numbers, in order
        return (v for v in map(_finite_float, map(logs.get, names)) if v is not None)

    gauges = {gauge: value for gauge, names in keys.items() if (value := next(numbers(names), None)) is not None}
    masked = [m for m in numbers(masked_keys) if math.isfinite(m)]
    if masked:
        gauges["masked_fraction"] = max(masked)
    return gauges


@dataclass
class _AlarmState:
    active: bool = False
    hits: int = 0
    misses: int = 0
    since_emit: int = 0
    raised_step: int | None = None


class HealthTracker:
    """Applies the health rules to a stream of log records, with debouncing.

    Args:
        config ([`HealthConfig`], *optional*): thresholds and debouncing; defaults when `None`.
        max_completion_length (`int`, *optional*): completion cap when `config.max_completion_length` is unset.
        kl_target (`float`, *optional*): the KL target when `config.kl_target` is unset (the KL alarm is off
            without one).

    Example:
    ```python
    tracker = HealthTracker()
    for record in trainer.state.log_history:
        for event in tracker.update(record, step=record.get("step")):
            print(event.message())
    ```
    """

    def __init__(
        self,
        config: HealthConfig | None = None,
        max_completion_length: int | None = None,
        kl_target: float | None = None,
    ):
        self.config = config or HealthConfig()
        self.max_completion_length = self.config.max_completion_length or max_completion_length
        self.kl_target = self.config.kl_target or kl_target
        self.states = {name: _AlarmState() for name in ALARMS if name not in self.config.disabled_alarms}
        self.rewards: deque[float] = deque(maxlen=self.config.plateau_window)
        self.reward_ceiling: float | None = None
        self._references: dict[str, list[float]] = {g: [] for g in _REFERENCE_GAUGES}
        self.last_gauges: dict[str, float] = {}

    @property
    def active(self) -> list[str]:
        return [name for name, state in self.states.items() if state.active]

    def critical_held_since(self) -> int | None:
        """Earliest step at which a currently active critical alarm was raised, or None."""
        critical = self.config.critical
        return min((s.raised_step for n, s in self.states.items() if s.active and n in critical), default=None)

    def _reference(self, gauge: str, value: float | None = None) -> float | None:
        """The run's reference of `gauge` (the median of its first `reference_window` finite values), None while
        they are being taken; `value`, given, is one more of them."""
        values = self._references[gauge]
        if len(values) < self.config.reference_window:
            if value is not None and math.isfinite(value):
                values.append(value)
            return None
        return statistics.median(values)

    def _conditions(self, gauges: dict[str, float]) -> dict[str, tuple[bool, float | None, float | None]]:
        """alarm -> (holds, value, threshold) for the alarms this record has data for."""
        cfg = self.config
        out: dict[str, tuple[bool, float | None, float | None]] = {}

        nonfinite = {k: gauges[k] for k in ("loss", "grad_norm", "reward") if k in gauges}
        if nonfinite:
            bad = {k: v for k, v in nonfinite.items() if not math.isfinite(v)}
            out["nonfinite"] = (bool(bad), ", ".join(f"{k}={v}" for k, v in bad.items()) or None, None)
        finite = {k: v for k, v in gauges.items() if math.isfinite(v)}

        def above(alarm: str, gauge: str, threshold: float | None) -> None:  # None: no threshold, the alarm is off
            if gauge in finite and threshold is not None:
                out[alarm] = (finite[gauge] > threshold, finite[gauge], threshold)

        above("zero_std", "frac_reward_zero_std", cfg.zero_std_alarm)

        if "reward" in finite:
            reward = finite["reward"]
            self.rewards.append(reward)
            self.reward_ceiling = reward if self.reward_ceiling is None else max(self.reward_ceiling, reward)
            if cfg.reward_max is not None:
                out["reward_above_max"] = (reward > cfg.reward_max + 1e-6, reward, cfg.reward_max)
                if len(self.rewards) == cfg.plateau_window:
                    window = list(self.rewards)
                    half = len(window) // 2
                    first, second = statistics.fmean(window[:half]), statistics.fmean(window[half:])
                    flat = second - first < cfg.plateau_min_rise
                    below = second < cfg.reward_max - cfg.ceiling_margin
                    out["reward_plateau"] = (flat and below, second, cfg.reward_max)

        # A confident model starts below the absolute entropy floor: entropy is judged only against its own start.
        relative = (
            ("grad_norm", "grad_norm_vanishing", cfg.grad_norm_floor, cfg.grad_norm_relative_floor, False),
            ("entropy", "entropy_collapse", cfg.entropy_floor, cfg.entropy_relative_floor, True),
        )
        for gauge, alarm, absolute, fraction, needs_reference in relative:
            reference = self._reference(gauge, finite[gauge]) if gauge in finite else None
            if gauge in finite and (reference is not None or not needs_reference):
                floor = floor_from_reference(reference, absolute, fraction)
                out[alarm] = (finite[gauge] < floor, finite[gauge], floor)

        if (length_condition := self._length_condition(finite)) is not None:
            out["length_near_cap"] = length_condition
        above("mismatch", "mismatch", cfg.mismatch_threshold)
        above("token_filter_masked", "masked_fraction", cfg.masked_fraction_alarm)
        above("retokenization", "retokenization", 0.0)
        above("kl_above_target", "kl", cfg.kl_alarm_ratio * self.kl_target if self.kl_target else None)
        return out

    def _length_condition(self, finite: dict[str, float]) -> tuple[bool, float | None, float | None] | None:
        """Completions running into the cap more than they did at the start: the mean length reaching
        `length_cap_ratio` of the cap from below (needs the cap), or the truncated share rising by
        `clipped_ratio_alarm` over its reference (needs no cap). Judged against the run's own start, as the relative
        floors are: a run sampled at a fixed or drawn length is truncated from its first step by design."""
        cfg = self.config
        cap = self.max_completion_length
        length = finite.get("completion_length") if cap else None
        clipped = finite.get("clipped_ratio")
        length_ref = None if length is None else self._reference("completion_length", length)
        clipped_ref = None if clipped is None else self._reference("clipped_ratio", clipped)
        if length_ref is None and clipped_ref is None:  # no data, or the reference is still being taken
            return None
        near = length_ref is not None and length_ref < cfg.length_cap_ratio * cap <= length
        truncated = clipped_ref is not None and clipped >= clipped_ref + cfg.clipped_ratio_alarm
        return near or truncated, length, cap

    def update(self, logs: Mapping[str, Any], step: int | None = None) -> list[HealthEvent]:
        """Feed one log record; return the alarm events it triggers (raised, repeated, cleared).

        Records without any gauge (e.g. the end-of-training summary, evaluation logs) change nothing.
        """
        gauges = self.last_gauges = extract_gauges(logs, self.config.metric_keys)
        if not gauges:
            return []
        step = int(step if step is not None else logs.get("step", 0) or 0)
        events = []
        for name, (holds, value, threshold) in self._conditions(gauges).items():
            state = self.states.get(name)  # None: a disabled alarm
            kind = None if state is None else self._advance(name, state, holds, step)
            if kind is not None:
                severity = CRITICAL if name in self.config.critical else "warning"
                symptom, cause, remedy = self._symptom(name, value, threshold), ALARMS[name].cause, ALARMS[name].remedy
                value = value if isinstance(value, (int, float)) else None
                since = state.raised_step if kind == "repeated" else None
                events.append(HealthEvent(step, kind, name, severity, value, threshold, symptom, cause, remedy, since))
        return events

    def _advance(self, name: str, state: _AlarmState, holds: bool, step: int) -> str | None:
        """Debounce one alarm's condition; return the event kind it emits now ("raised", "repeated", "cleared")."""
        cfg = self.config
        # Failures that corrupt the weights must not wait. A trend measured over a sliding window flickers with the
        # reward's noise: a plateau must hold for a fifth of a window before it is raised and give way to half a
        # window of rise before it clears.
        plateau = name == "reward_plateau"
        raise_after = {"nonfinite": 1, "kl_above_target": cfg.kl_patience}.get(name, cfg.patience)
        raise_after = max(cfg.patience, cfg.plateau_window // 5) if plateau else raise_after
        clear_after = max(cfg.clear_patience, cfg.plateau_window // 2) if plateau else cfg.clear_patience
        if not holds:
            state.hits, state.misses = 0, state.misses + 1
            if state.active and state.misses >= clear_after:
                state.active, state.raised_step = False, None
                return "cleared"
            return None
        state.hits, state.misses = state.hits + 1, 0
        if not state.active:
            if state.hits < raise_after:
                return None
            state.active, state.raised_step, state.since_emit = True, step, 0
            return "raised"
        state.since_emit += 1
        if cfg.repeat_every and state.since_emit >= cfg.repeat_every:
            state.since_emit = 0
            return "repeated"
        return None

    def _symptom(self, name: str, value, threshold) -> str:
        """The catalogue's symptom filled with the measured values, plus what the other gauges add to it."""
        if name == "length_near_cap":
            parts = []
            if value is not None and threshold:
                part = f"mean completion length {value:.1f} is {value / threshold:.0%} of the cap {threshold:.0f}"
                start = self._reference("completion_length")
                parts.append(part + (f" (it started at {start:.1f})" if start is not None else ""))
            clipped = self.last_gauges.get("clipped_ratio")
            if clipped is not None:
                part = f"{clipped:.0%} of completions truncated at the cap"
                start = self._reference("clipped_ratio")
                if start is not None:
                    rise = 100 * self.config.clipped_ratio_alarm
                    part += f", up from {start:.0%} at the start (alarm at a rise of {rise:.0f} points)"
                parts.append(part)
            return ", ".join(parts)
        # every other alarm's value and threshold are numbers (nonfinite's value a text), as its template expects
        gauges, healthy = self.last_gauges, self.config.zero_std_healthy
        symptom = ALARMS[name].symptom.format(value=value, threshold=threshold, healthy=healthy)
        if name == "reward_plateau" and self.reward_ceiling is not None:
            symptom += f"; best reward reached {self.reward_ceiling:.3f}"
        if name == "mismatch":  # the spread behind the mean |diff|
            extra = [f"max {gauges['mismatch_max']:.3f}"] if "mismatch_max" in gauges else []
            if "mismatch_outside_band" in gauges:
                low, high = self.config.mismatch_band
                extra.append(f"{gauges['mismatch_outside_band']:.1%} of token ratios outside [{low}, {high}]")
            symptom += f" ({', '.join(extra)})" if extra else ""
        if name == "kl_above_target":  # how far above the target, and the coefficient that failed to hold it
            symptom += f" ({value / self.kl_target:.1f}x the target {self.kl_target:g}"
            symptom += f"; kl_coef {gauges['kl_coef']:.3g})" if "kl_coef" in gauges else ")"
        return symptom

    def meta(self) -> dict[str, Any]:
        """The settings a dashboard needs to shade this run's bands, with the completion cap and KL target in use."""
        scalars = {k: v for k, v in self.config.to_dict().items() if isinstance(v, (int, float, str, type(None)))}
        return {
            **scalars,
            "mismatch_band": list(self.config.mismatch_band),
            "max_completion_length": self.max_completion_length,
            "kl_target": self.kl_target,
        }

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything `update` carries from one record to the next, as plain values for a checkpoint."""
        return {
            "alarms": {name: asdict(state) for name, state in self.states.items()},
            "rewards": list(self.rewards),
            "reward_ceiling": self.reward_ceiling,
            "references": {gauge: list(values) for gauge, values in self._references.items()},
            "max_completion_length": self.max_completion_length,
        }

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """Continue from `checkpoint_state()`'s output, as the saved run would have; alarms disabled then start from
        rest, saved alarms disabled now are ignored."""
        self.states.update({name: _AlarmState(**s) for name, s in state["alarms"].items() if name in self.states})
        self.rewards = deque(state["rewards"], maxlen=self.config.plateau_window)
        self.reward_ceiling = state["reward_ceiling"]
        self._references = {gauge: list(state["references"].get(gauge, [])) for gauge in self._references}
        if self.config.max_completion_length is None and state["max_completion_length"] is not None:
            self.max_completion_length = state["max_completion_length"]

    def flags(self) -> dict[str, float]:
        """`health/*` metrics for the trainer's logs: the number of active alarms and one 0/1 flag per alarm."""
        flags = {"health/active_alarms": float(len(self.active))}
        flags.update({f"health/alarm/{name}": float(state.active) for name, state in self.states.items()})
        if self.reward_ceiling is not None:  # the best reward/mean reached so far, to hold against reward_max
            flags["health/reward_ceiling"] = self.reward_ceiling
        return flags
