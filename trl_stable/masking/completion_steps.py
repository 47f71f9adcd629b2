"""Step validation for RL (GRPO and PPO): the checks of step-masked SFT on each sampled completion, as a keep mask the
trainer multiplies into its completion mask, so invalid steps' tokens carry no gradient and leave the normaliser."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trl_stable.masking.mask import build_step_loss_mask, check_steps, decode_offsets
from trl_stable.masking.validation import StepVerdict, find_tool_call_spans


@dataclass
class CompletionStepMasker:
    """Per-token keep masks for sampled completions: the tool-call blocks between `open_tag` and `close_tag` checked
    against `tools` (see `normalize_signatures`; None checks only JSON and a name), plus the steps of the optional
    ``extra_steps(text, index) -> list of step dicts`` (character boundaries, e.g. code steps with ``exec_status``).
    Calling it gives one list of floats (1 keep, 0 drop) per completion, `keep_mask` a (B, T) tensor; ``last_counts``
    holds the last call's step counts by reason.
    """

    tools: Mapping[str, Any] | Sequence[Any] | None = None
    open_tag: str = "<tool_call>"
    close_tag: str = "</tool_call>"
    extra_steps: Callable[[str, int], list[dict[str, Any]]] | None = None
    last_counts: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __call__(self, completion_ids: Sequence[Sequence[int]], tokenizer: Any) -> list[list[float]]:
        masks: list[list[float]] = []
        verdicts: list[StepVerdict] = []
        for index, ids in enumerate(completion_ids):
            ids = [int(i) for i in ids]
            text, offsets = decode_offsets(tokenizer, ids)
            steps = [
                {"start": a, "end": b, "unit": "char", "type": "tool_call"}
                for a, b in find_tool_call_spans(text, self.open_tag, self.close_tag)
            ]
            extra = self.extra_steps(text, index) if self.extra_steps is not None else None
            if extra is not None:
                check_steps(extra, f"extra_steps(text, {index})", len(ids), text, returned=True)
                steps += list(extra)
            result = build_step_loss_mask(
                ids, steps, text=text, offsets=offsets, tools=self.tools, open_tag=self.open_tag,
                close_tag=self.close_tag,
            )  # fmt: skip
            verdicts.extend(result.verdicts)
            masks.append(result.mask.tolist())
        self.last_counts = dict(Counter(verdict.reason for verdict in verdicts))
        return masks

    def keep_mask(self, completion_ids: torch.Tensor, completion_mask: torch.Tensor, tokenizer: Any) -> torch.Tensor:
        """A (B, T) keep mask for right-padded `completion_ids`, 0 on invalid steps (padding left to the caller)."""
        # Last kept position + 1, not the count: other masks (tool outputs, IcePop) may zero tokens mid-row.
        positions = torch.arange(1, completion_mask.size(1) + 1, device=completion_mask.device)
        lengths = ((completion_mask > 0) * positions).amax(dim=1).long().tolist()
        rows = [completion_ids[i, : lengths[i]].tolist() for i in range(completion_ids.size(0))]
        keep = torch.ones_like(completion_mask, dtype=torch.float32)
        for i, row in enumerate(self(rows, tokenizer)):
            keep[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
        return keep.to(completion_mask.device)

    def stats(self) -> dict[str, float]:
        """Metrics of the last call: steps checked and the share masked, by reason."""
        total = sum(self.last_counts.values())
        invalid = {f"step_mask/{reason}": float(n) for reason, n in self.last_counts.items() if reason != "ok"}
        frac = sum(invalid.values()) / total if total else 0.0
        return {"step_mask/steps": float(total), "step_mask/frac_invalid_steps": frac, **invalid}


def apply_step_mask(
    completion_mask: torch.Tensor, completion_ids: torch.Tensor, tokenizer: Any, masker: CompletionStepMasker
) -> torch.Tensor:
    """`completion_mask` with the tokens of invalid steps set to 0 (same dtype and device)."""
    keep = masker.keep_mask(completion_ids, completion_mask, tokenizer)
    return (completion_mask * keep.to(completion_mask.dtype)).to(completion_mask.dtype)
