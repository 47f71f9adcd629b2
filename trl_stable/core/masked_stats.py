"""Statistics over the masked (action) tokens of a batch: mean, moments and whitening, over every process if asked.

Pure torch. Whitening advantages and rewards over the batch's tokens follows Stiennon et al. 2020 (arXiv 2009.01325)
and Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO" (arXiv 2403.17031); old TRL's ``whiten``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["Reduce", "masked_mean", "masked_moments", "masked_whiten"]

# Sums a tensor over processes (``accelerator.reduce(t, "sum")``); every process must call it.
Reduce = Callable[[torch.Tensor], torch.Tensor]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""$\sum x m / \max(\sum m, 1)$."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def masked_moments(x: torch.Tensor, mask: torch.Tensor, reduce_sum: Reduce | None = None) -> tuple[torch.Tensor, ...]:
    r"""Masked mean and $\sqrt{\mathrm{var}_{unbiased} + 10^{-8}}$ of `x`, in float64 sums (old TRL's ``whiten``
    statistics, Huang et al. 2024, arXiv 2403.17031).

    `reduce_sum` sums a tensor over processes (``accelerator.reduce(t, "sum")``), so the moments are those of every
    process's tokens together; None for one process.
    """
    stats = torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()]).double()
    if reduce_sum is not None:
        stats = reduce_sum(stats)
    count = stats[2]
    mean = stats[0] / count.clamp(min=1)
    var = (stats[1] / count.clamp(min=1) - mean**2).clamp(min=0)
    if count > 1:
        var = var * count / (count - 1)
    return mean.float(), torch.sqrt(var.float() + 1e-8)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, reduce_sum: Reduce | None = None
) -> torch.Tensor:
    r"""$(x - \mu) / \sigma$ over the masked tokens (`masked_moments`); `shift_mean=False` adds $\mu$ back (old TRL's
    ``whiten(shift_mean=False)``, used for rewards). Masked positions are 0."""
    mean, std = masked_moments(x, mask, reduce_sum)
    out = (x - mean) / std
    if not shift_mean:
        out = out + mean
    return out * mask
