"""What GRPO logs through `trl.GRPOTrainer`'s own buffers: `_metrics`, the completions table `_logs`, and the
reward functions' `_pending_metrics` / `_pending_extra_logs` (`trl_stable.integration`: GRPO_MEMBERS, MIRRORED)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from accelerate.utils import gather_object

from trl_stable.monitoring.mismatch import mismatch_stats
from trl_stable.monitoring.reduction import logged_metric_stat, reduce_metrics


def train_mode(trainer: Any) -> str:
    """ "train" or "eval": the key of TRL's per-mode metric and log buffers."""
    return "train" if trainer.model.training else "eval"


def log_metric(trainer: Any, name: str, value: float) -> None:
    """Append a scalar to TRL's metric buffer (`_metrics[mode]`); TRL averages and logs it at the next `log`."""
    trainer._metrics[train_mode(trainer)][name].append(float(value))


def log_metrics(trainer: Any, metrics: Mapping[str, float]) -> None:
    """`log_metric` for each of `metrics`."""
    for name, value in metrics.items():
        log_metric(trainer, name, value)


def flush_reward_logs(trainer: Any, num_local: int) -> None:
    """Flush what reward functions logged through ``log_extra`` / ``log_metric`` since TRL's own flush, as TRL does
    (a collective); `num_local` completions on this process."""
    for column in sorted(set(gather_object(list(trainer._pending_extra_logs)))):
        values = trainer._pending_extra_logs.get(column, [None] * num_local)
        trainer._logs["extra"][column].extend(gather_object(values))
    trainer._pending_extra_logs.clear()
    flush_reward_metrics(trainer)


def flush_reward_metrics(trainer: Any, select: Callable[[str], bool] | None = None) -> None:
    """Move TRL's `_pending_metrics` (those `select` accepts; None: all) into its metric buffer, reduced over
    processes as `logged_metric_stat` names (TRL's mean for unknown names). A collective."""
    # sorted union: every process reduces the same names in the same order, those it did not log with no share
    names = [
        name for name in sorted(set(gather_object(list(trainer._pending_metrics)))) if select is None or select(name)
    ]
    stats = {name: logged_metric_stat(name, trainer._pending_metrics.pop(name, [])) for name in names}
    log_metrics(trainer, reduce_metrics(stats, trainer.accelerator))  # no names: no collective, nothing logged


def replace_logged_advantages(trainer: Any, advantages: Sequence[float]) -> None:
    """Replace the advantages TRL just put in its completions table (`_logs["advantages"]`) by `advantages`."""
    logged = trainer._logs["advantages"]  # a bounded deque in TRL 1.16: no slice deletion
    for _ in range(min(len(logged), len(advantages))):
        logged.pop()
    logged.extend(advantages)


def log_generation_mismatch(trainer: Any, output: dict[str, Any]) -> None:
    """Log `mismatch/*` between `sampling_per_token_logps` and `old_per_token_logps` (recomputed, not stored, when
    missing and `health_mismatch_monitor` is on)."""
    monitor = getattr(trainer, "health_monitor", None)
    behav = output.get("sampling_per_token_logps")
    if monitor is None or behav is None:
        return
    prox = output.get("old_per_token_logps")
    if prox is None:
        if not getattr(trainer.args, "health_mismatch_monitor", False):
            return
        prox = trainer._compute_proximal_logps(output)
    with torch.no_grad():
        stats = mismatch_stats(
            behav,
            prox,
            output["completion_mask"],
            band=monitor.config.mismatch_band,
            gather=trainer.accelerator.gather,  # every process takes this path together
        )
    log_metrics(trainer, stats.as_metrics())
