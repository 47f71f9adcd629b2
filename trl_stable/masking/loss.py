"""Masked cross-entropy for step-masked SFT (docs/agent_steps.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    shift: bool = True,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Mean next-token cross-entropy over the valid tokens only.

    loss = sum_t m_t * CE(logits_t, y_t) / max(1, sum_t m_t)

    where m_t is `loss_mask` times ``labels != ignore_index``: an all-invalid batch is a finite zero, masked tokens
    neither dilute the valid ones' gradient nor get any.

    Args:
        logits: (B, T, V) model outputs.
        labels: (B, T) target ids (usually the input ids); `ignore_index` marks positions without a target.
        loss_mask: (B, T) float or bool mask aligned with `labels`; None = all ones.
        shift: Predict token t+1 from position t (causal LM convention): logits[:, :-1] vs labels[:, 1:], and the
            mask of the *target* token applies.
        ignore_index: Label value that is never trained.

    Returns:
        A scalar tensor.
    """
    if shift:
        logits, labels = logits[:, :-1, :], labels[:, 1:]
        loss_mask = loss_mask[:, 1:] if loss_mask is not None else None
    valid = labels != ignore_index
    mask = valid.to(logits.dtype) if loss_mask is None else loss_mask.to(logits.dtype) * valid.to(logits.dtype)
    weights = mask.float().reshape(-1)
    # Only the kept positions enter the cross-entropy: a masked position with non-finite logits (a broken step can
    # produce them) then cannot leak NaN into the loss or the gradient, as a multiply-by-zero would.
    keep = (weights > 0).nonzero(as_tuple=True)[0]
    flat_logits = logits.reshape(-1, logits.size(-1))[keep].float()
    per_token = F.cross_entropy(flat_logits, labels.reshape(-1)[keep], reduction="none")
    return (per_token * weights[keep]).sum() / weights.sum().clamp(min=1.0)
