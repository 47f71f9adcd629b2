"""What GRPO logs through `trl.GRPOTrainer`'s own buffers: its metric buffer (`_metrics`, averaged and logged by
TRL's `log`), the completions table (`_logs`) and the buffers reward functions fill through TRL's ``log_metric`` /
``log_extra`` hooks (`_pending_metrics`, `_pending_extra_logs`). The members are listed in
`trl_stable.integration` (trl_members.GRPO_MEMBERS, mirrored.MIRRORED)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def flush_reward_logs(trainer: Any, num_local: int) -> None:
    """Flush what reward functions logged through ``log_extra`` / ``log_metric`` since TRL's own flush, as TRL does
    right after `_calculate_rewards` (columns gathered; metrics reduced over processes by `flush_reward_metrics`). A
    collective: every process calls it. GRPO calls it after the dense reward functions it collects later than TRL's
    flush.

    Args:
        num_local: Completions on this process (the length of a column no function logged here).
    """
    for column in sorted(set(gather_object(list(trainer._pending_extra_logs)))):
        values = trainer._pending_extra_logs.get(column, [None] * num_local)
        trainer._logs["extra"][column].extend(gather_object(values))
    trainer._pending_extra_logs.clear()
    flush_reward_metrics(trainer)


def flush_reward_metrics(trainer: Any, select: Callable[[str], bool] | None = None) -> None:
    """Move the metrics reward functions logged through ``log_metric`` (TRL's `_pending_metrics`) into TRL's metric
    buffer, reduced over processes: TRL's mean over every call for metrics trl_stable does not know, the kind
    `trl_stable.monitoring.reduction.logged_metric_stat` names for the ones it does (the critic's counts summed and
    its fractions recomputed from them, ...). A collective: every process calls it.

    Args:
        select: Flush only the names it accepts (the others stay for TRL's own flush); None: all.
    """
    # sorted union: every process reduces the same names in the same order, those it did not log with no share
    names = [
        name for name in sorted(set(gather_object(list(trainer._pending_metrics)))) if select is None or select(name)
    ]
    if not names:
        return
    stats = {name: logged_metric_stat(name, trainer._pending_metrics.pop(name, [])) for name in names}
    mode = train_mode(trainer)
    for name, value in reduce_metrics(stats, trainer.accelerator).items():
        trainer._metrics[mode][name].append(value)


def replace_logged_advantages(trainer: Any, advantages: Sequence[float]) -> None:
    """Replace the advantages TRL just put in its completions table (`_logs["advantages"]`) by `advantages`."""
    logged = trainer._logs["advantages"]  # a bounded deque in TRL 1.16: no slice deletion
    for _ in range(min(len(logged), len(advantages))):
        logged.pop()
    logged.extend(advantages)


def log_generation_mismatch(trainer: Any, output: dict[str, Any]) -> dict[str, float] | None:
    """Log `mismatch/*` for a GRPO generation batch when it carries both sides' log-probs.

    The sampler side is TRL's `sampling_per_token_logps` (vLLM, or HF generation when a trl_stable option records
    it); the trainer side is `old_per_token_logps`. When the trainer side is missing and `health_mismatch_monitor` is
    on, it is recomputed with `trainer._compute_proximal_logps` (no gradient, not stored in the batch, so the loss is
    untouched). Returns the metrics, or None when nothing was logged.
    """
    monitor = getattr(trainer, "health_monitor", None)
    behav = output.get("sampling_per_token_logps")
    if monitor is None or behav is None:
        return None
    prox = output.get("old_per_token_logps")
    if prox is None:
        if not getattr(trainer.args, "health_mismatch_monitor", False):
            return None
        prox = trainer._compute_proximal_logps(output)
    with torch.no_grad():
        stats = mismatch_stats(
            behav,
            prox,
            output["completion_mask"],
            band=monitor.config.mismatch_band,
            gather=trainer.accelerator.gather,  # every process takes this path together
        )
    metrics = stats.as_metrics()
    for name, value in metrics.items():
        log_metric(trainer, name, value)
    return metrics
