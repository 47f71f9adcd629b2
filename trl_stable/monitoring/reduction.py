"""Logged metrics reduced across processes: with P processes, every process logs what one process holding the global
batch would log (docs/grpo.md, docs/ppo.md).

A metric is a [`Stat`]: this process's share of it, as sufficient statistics, and the kind of reduction that
combines the shares; [`reduce_metrics`] combines every process's shares with one `gather`. The kinds:

- ``"mean"``: Σ sums / Σ counts, a mean over every process's items weighted by their number, never a mean of
  per-process means; a fraction is a ratio of global counts (`Stat.ratio`).
- ``"sum"``: counts, added up.
- ``"max"`` / ``"min"``: the extreme over the processes that have an item (the slowest process sets the pace).
- ``"std"``: (count, mean, sum of squared deviations), combined exactly (Chan et al., 1979) into the unbiased
  standard deviation of every process's items.

A value every process already holds (a config value, a statistic of gathered data) is a plain float and passes
through unchanged; a metric a reward function logs through TRL's ``log_metric`` hook gets its kind by name
(`logged_metric_stat`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trl_stable.monitoring.metric_names import (
    CRITIC_STEP_PREFIX,
    MAX_LOGGED_METRICS,
    SUMMED_LOGGED_METRICS,
    critic_step_ratios,
)

_KINDS = ("mean", "sum", "min", "max", "std")
Number = float | int | torch.Tensor


def _items(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    x = x.detach().double()
    if mask is not None:
        x = x[mask.to(x.device).bool().expand_as(x)]
    return x.reshape(-1)


@dataclass(frozen=True)
class Stat:
    """One process's share of a logged metric; build it with the class methods.

    Attributes:
        kind: "mean", "sum", "min", "max" or "std" (see the module docstring).
        value: mean: the sum of the items; sum: the count; min/max: the local extreme; std: the local mean.
        count: The number of items behind `value` (0: this process has none; ignored by "sum").
        m2: std only: the local sum of squared deviations from the local mean.
        empty: The global value when no process has an item (a mean of nothing, the extreme of nothing).
    """

    kind: str
    value: Number = 0.0
    count: Number = 0.0
    m2: Number = 0.0
    empty: float = 0.0

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"Stat kind {self.kind!r} is unknown; use one of {', '.join(_KINDS)}.")

    @classmethod
    def mean(cls, x: torch.Tensor, mask: torch.Tensor | None = None, empty: float = 0.0) -> Stat:
        """The mean of the entries of `x` (where `mask` is true) over every process."""
        items = _items(x, mask)
        return cls("mean", items.sum(), items.numel(), empty=empty)

    @classmethod
    def ratio(cls, numerator: Number, denominator: Number, empty: float = 0.0) -> Stat:
        """Σ numerators / Σ denominators over processes (a fraction of global counts, or a weighted mean)."""
        return cls("mean", numerator, denominator, empty=empty)

    @classmethod
    def total(cls, count: Number) -> Stat:
        """The sum of `count` over processes."""
        return cls("sum", count)

    @classmethod
    def max(cls, x: Number, mask: torch.Tensor | None = None, empty: float = 0.0) -> Stat:
        """The largest entry of `x` (a number, or a tensor's entries where `mask` is true) over every process."""
        return cls._extreme("max", x, mask, empty)

    @classmethod
    def min(cls, x: Number, mask: torch.Tensor | None = None, empty: float = 0.0) -> Stat:
        """The smallest entry of `x` over every process."""
        return cls._extreme("min", x, mask, empty)

    @classmethod
    def _extreme(cls, kind: str, x: Number, mask: torch.Tensor | None, empty: float) -> Stat:
        if not torch.is_tensor(x):
            return cls(kind, float(x), 1.0, empty=empty)
        items = _items(x, mask)
        if items.numel() == 0:
            return cls(kind, 0.0, 0.0, empty=empty)
        return cls(kind, items.amax() if kind == "max" else items.amin(), items.numel(), empty=empty)

    @classmethod
    def std(cls, x: torch.Tensor, mask: torch.Tensor | None = None, empty: float = 0.0) -> Stat:
        """The unbiased standard deviation of the entries of `x` over every process (`empty` with < 2 of them)."""
        items = _items(x, mask)
        if items.numel() == 0:
            return cls("std", 0.0, 0.0, 0.0, empty=empty)
        mean = items.mean()
        return cls("std", mean, items.numel(), (items - mean).square().sum(), empty=empty)


def _row(stat: Stat, device: torch.device) -> torch.Tensor:
    return torch.stack(
        [torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in (stat.value, stat.count, stat.m2)]
    )


def _combine(stat: Stat, rows: torch.Tensor) -> float:
    """The global value of `stat` from every process's row ([P, 3]: value, count, m2)."""
    value, count, m2 = rows[:, 0], rows[:, 1], rows[:, 2]
    n = count.sum().item()
    if stat.kind == "sum":
        return value.sum().item()
    if stat.kind == "mean":
        return value.sum().item() / n if n > 0 else stat.empty
    has = count > 0
    if stat.kind in ("max", "min"):
        if not bool(has.any()):
            return stat.empty
        return (value[has].max() if stat.kind == "max" else value[has].min()).item()
    # std: the parallel variance of Chan, Golub & LeVeque (1979), exact for any split of the items
    if n < 2:
        return stat.empty
    mean = (value * count).sum() / n
    total_m2 = m2.sum() + (count * (value - mean).square()).sum()
    return math.sqrt(max(total_m2.item(), 0.0) / (n - 1))


def reduce_metrics(
    metrics: Mapping[str, Stat | float], accelerator: Any | None = None, names_may_differ: bool = False
) -> dict[str, float]:
    """The global value of every metric: `Stat`s reduced over processes, plain floats (already global) passed through,
    in the order of `metrics` (names only other processes logged last); `accelerator` None for one process.

    A collective with several processes: every process passes the same metric names (checked; a mismatch raises on
    every process), or ``names_may_differ=True`` (one more `gather_object`; a name absent on a process contributes
    nothing there). The critic's per-call fractions are recomputed from its summed ``critic/step_*`` counts."""
    stats = {name: stat for name, stat in metrics.items() if isinstance(stat, Stat)}
    multi = accelerator is not None and accelerator.num_processes > 1
    if multi and names_may_differ:
        from accelerate.utils import gather_object

        known: dict[str, Stat] = {}
        for name, kind, empty in gather_object([(n, s.kind, s.empty) for n, s in sorted(stats.items())]):
            if name in known and known[name].kind != kind:
                raise ValueError(
                    f"Metric {name!r} is reduced as {known[name].kind!r} and {kind!r} on different processes."
                )
            known.setdefault(name, Stat(kind, empty=empty))
        stats = {name: stats.get(name, known[name]) for name in sorted(known)}  # absent here: a zero share
    names = sorted(stats)
    if not names:
        return {name: float(value) for name, value in metrics.items()}
    device = accelerator.device if accelerator is not None else torch.device("cpu")
    rows = torch.stack([_row(stats[name], device) for name in names])
    if multi:
        checksum = float(zlib.crc32("\0".join(names).encode()))
        check = torch.tensor([[checksum, len(names), 0.0]], dtype=torch.float64, device=device)
        gathered = accelerator.gather(torch.cat([rows, check]).unsqueeze(0)).reshape(-1, len(names) + 1, 3).cpu()
        if not bool((gathered[:, -1] == gathered[0, -1]).all()):
            raise ValueError(
                "reduce_metrics got different metric names on different processes; pass names_may_differ=True for "
                f"metrics only some processes log (this process: {names})."
            )
        per_process = gathered[:, :-1]
    else:
        per_process = rows.cpu().unsqueeze(0)
    reduced = {name: _combine(stats[name], per_process[:, i]) for i, name in enumerate(names)}
    # derived metrics: the critic's fractions from its summed counts, not the mean of each process's fractions
    counts = {name[len(CRITIC_STEP_PREFIX) :]: v for name, v in reduced.items() if name.startswith(CRITIC_STEP_PREFIX)}
    reduced.update({name: v for name, v in critic_step_ratios(counts).items() if name in reduced})
    out = {name: reduced[name] if name in reduced else float(value) for name, value in metrics.items()}
    return {**out, **reduced}  # then the names only other processes logged


def dense_reward_stats(metrics: Mapping[str, float], completion_lengths: Sequence[int]) -> dict[str, Stat]:
    """The `trl_stable.rewards.dense.DenseRewards` metrics of this process's completions as `Stat`s.

    ``rewards/<name>/token_mean`` is a mean over completion tokens, ``rewards/<name>/sum_mean`` over completions,
    ``rewards/<name>/nan_tokens`` a count; any other metric is a mean over processes.
    """
    tokens, rows = float(sum(completion_lengths)), float(len(completion_lengths))
    out: dict[str, Stat] = {}
    for name, value in metrics.items():
        count = {"/token_mean": tokens, "/sum_mean": rows}.get(name[name.rfind("/") :])
        if count is not None:  # the local mean divides by max(count, 1): undo exactly that
            out[name] = Stat.ratio(value * max(count, 1.0), count)
        elif name.endswith("/nan_tokens"):
            out[name] = Stat.total(value)
        else:
            out[name] = Stat.ratio(value, 1.0)
    return out


def logged_metric_stat(name: str, values: Sequence[float]) -> Stat:
    """The share of a metric a reward function logged `values` of (one per call) through TRL's ``log_metric`` hook.

    Counts trl_stable's reward functions log (``critic/step_*``, ``arena/*judge_calls``) are summed, the critic's
    stage and wait times take the maximum, and everything else is TRL's rule for these metrics: the mean over every
    call.
    """
    values = [float(v) for v in values]
    if name.startswith(CRITIC_STEP_PREFIX) or name in SUMMED_LOGGED_METRICS:
        return Stat.total(sum(values))
    if name in MAX_LOGGED_METRICS:
        return Stat("max", max(values), 1.0) if values else Stat("max")
    return Stat.ratio(sum(values), len(values))


def has_own_reduction(name: str) -> bool:
    """Whether `logged_metric_stat` reduces the ``log_metric`` metric `name` other than by TRL's mean over calls (a
    count, a wall time, or a critic fraction recomputed from counts)."""
    return name.startswith("critic/") or name in SUMMED_LOGGED_METRICS or name in MAX_LOGGED_METRICS


def step_mask_stats(metrics: Mapping[str, float]) -> dict[str, Stat]:
    """`trl_stable.masking.CompletionStepMasker.stats` of this process's completions as `Stat`s: the step counts are
    summed, ``step_mask/frac_invalid_steps`` is recomputed from the global counts. A process logs the per-reason counts
    of the reasons it saw only: reduce with ``names_may_differ=True``."""
    steps, frac = metrics.get("step_mask/steps", 0.0), "step_mask/frac_invalid_steps"
    # the fraction is invalid / steps of whole counts: round away the division
    return {n: Stat.ratio(round(v * steps), steps) if n == frac else Stat.total(v) for n, v in metrics.items()}
