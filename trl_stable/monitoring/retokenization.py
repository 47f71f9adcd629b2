"""Re-tokenization check for multi-turn and agent runs: when the trainer re-encodes a conversation, its token ids
must be the sampler's, or the loss scores a different sequence (the `retokenization` alarm)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["RetokenizationReport", "check_retokenization", "drop_mismatched"]

IdSequences = Sequence[Sequence[int]] | torch.Tensor


@dataclass(frozen=True)
class RetokenizationReport:
    """Outcome of [`check_retokenization`].

    Attributes:
        first_diff (`list[int]`):
            Per sample, the first position where the trainer's ids differ from the sampler's (a length difference
            counts at the shorter length); -1 where they are equal.
        sampler_ids, trainer_ids (`list[list[int]]`):
            The compared sequences (padding removed), kept to describe the mismatches.
    """

    first_diff: list[int]
    sampler_ids: list[list[int]] = field(repr=False)
    trainer_ids: list[list[int]] = field(repr=False)

    @property
    def num_samples(self) -> int:
        return len(self.first_diff)

    @property
    def mismatched(self) -> list[int]:
        """Indices of the samples whose ids differ."""
        return [i for i, pos in enumerate(self.first_diff) if pos >= 0]

    @property
    def num_mismatched(self) -> int:
        return len(self.mismatched)

    @property
    def keep(self) -> torch.Tensor:
        """Bool tensor `(B,)`, True for samples whose re-encoding matches."""
        return torch.tensor([pos < 0 for pos in self.first_diff], dtype=torch.bool)

    def as_metrics(self, prefix: str = "retokenization/") -> dict[str, float]:
        n = self.num_samples
        return {
            f"{prefix}mismatched": float(self.num_mismatched),
            f"{prefix}mismatched_frac": self.num_mismatched / n if n else 0.0,
        }

    def describe(self, max_samples: int = 3, context: int = 3, decode=None) -> str:
        """One line per mismatching sample (at most `max_samples`): index, first differing position and the ids
        around it on both sides. `decode`, e.g. `tokenizer.decode`, renders the ids as text too."""
        if not self.num_mismatched:
            return f"re-tokenization: all {self.num_samples} samples match"
        lines = [f"re-tokenization: {self.num_mismatched}/{self.num_samples} samples differ"]
        for i in self.mismatched[:max_samples]:
            pos = self.first_diff[i]
            lo, hi = max(pos - context, 0), pos + context + 1
            s, t = self.sampler_ids[i][lo:hi], self.trainer_ids[i][lo:hi]
            line = f"  sample {i}: first difference at token {pos}: sampler {s} vs trainer {t}"
            if decode is not None:
                line += f" ({decode(s)!r} vs {decode(t)!r})"
            lines.append(line)
        if self.num_mismatched > max_samples:
            lines.append(f"  ... and {self.num_mismatched - max_samples} more")
        return "\n".join(lines)


def _as_lists(ids: IdSequences, mask: torch.Tensor | None) -> list[list[int]]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 2:
            raise ValueError(f"token ids must be (batch, length), got shape {tuple(ids.shape)}.")
        if mask is None:
            return [row.tolist() for row in ids]
        if mask.shape != ids.shape:
            raise ValueError(f"mask {tuple(mask.shape)} must match the ids {tuple(ids.shape)}.")
        return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
    if mask is not None:
        raise ValueError("a mask is only accepted with tensor ids; pass lists already stripped of padding.")
    return [list(map(int, row)) for row in ids]


def check_retokenization(
    sampler_ids: IdSequences,
    trainer_ids: IdSequences,
    sampler_mask: torch.Tensor | None = None,
    trainer_mask: torch.Tensor | None = None,
) -> RetokenizationReport:
    """Compare, sample by sample, the token ids the sampler produced with the trainer's re-encoding.

    Args:
        sampler_ids, trainer_ids (`list[list[int]]` or `torch.Tensor` of shape `(B, L)`):
            The same conversations as token ids. Tensors may be padded; pass their attention masks to strip padding
            (padding may sit on either side).
        sampler_mask, trainer_mask (`torch.Tensor` of shape `(B, L)`, *optional*):
            1 on real tokens.

    Returns:
        [`RetokenizationReport`]: first differing position per sample, the keep-mask and metrics.
    """
    s_lists, t_lists = _as_lists(sampler_ids, sampler_mask), _as_lists(trainer_ids, trainer_mask)
    if len(s_lists) != len(t_lists):
        raise ValueError(f"sampler has {len(s_lists)} samples but trainer has {len(t_lists)}; pass the same batch.")
    first_diff = []
    for s, t in zip(s_lists, t_lists, strict=True):
        same_prefix = -1 if len(s) == len(t) else min(len(s), len(t))  # a length difference counts there
        first_diff.append(next((k for k, (a, b) in enumerate(zip(s, t, strict=False)) if a != b), same_prefix))
    return RetokenizationReport(first_diff=first_diff, sampler_ids=s_lists, trainer_ids=t_lists)


def drop_mismatched(completion_mask: torch.Tensor, report: RetokenizationReport) -> torch.Tensor:
    """A new `completion_mask` (B, T), same dtype, with the rows of the samples whose re-encoding differs (`report`, of
    the same batch) zeroed, so they leave the loss."""
    if completion_mask.shape[0] != report.num_samples:
        raise ValueError(
            f"completion_mask has {completion_mask.shape[0]} rows but the report covers {report.num_samples} samples."
        )
    return completion_mask * report.keep.to(completion_mask.device, completion_mask.dtype).unsqueeze(1)
