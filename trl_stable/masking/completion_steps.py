"""Step validation for RL (GRPO and PPO): the checks of step-masked SFT on each sampled completion, as a keep mask the
trainer multiplies into its completion mask, so invalid steps' tokens carry no gradient and leave the normaliser."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trl_stable.masking.mask import StepSpanError, build_step_loss_mask, check_step, decode_offsets
from trl_stable.masking.validation import StepVerdict, count_reasons, find_tool_call_spans


@dataclass
class CompletionStepMasker:
    """Per-token keep masks for sampled completions.

    Args:
        tools: Valid tools (names, ``{name: signature}`` or OpenAI specs); None checks only JSON and a name.
        open_tag / close_tag: Delimiters of a tool-call block in the completion.
        extra_steps: Optional ``f(text, index) -> list of step dicts`` (character boundaries into the completion
            text, see `build_step_loss_mask`), e.g. code steps whose ``exec_status`` the environment reported.

    Calling it returns one list of floats (1 keep, 0 drop) per completion; `keep_mask` returns a (B, T) tensor.
    The counts of the last call, by failure reason, are in ``last_counts``.
    """

    tools: Mapping[str, Any] | Sequence[Any] | None = None
    open_tag: str = "<tool_call>"
    close_tag: str = "</tool_call>"
    extra_steps: Callable[[str, int], list[dict[str, Any]]] | None = None

    def __post_init__(self):
        self.last_counts: dict[str, int] = {}

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
            if self.extra_steps is not None:
                steps += self._extra_steps(text, index, len(ids))
            if not steps:
                masks.append([1.0] * len(ids))
                continue
            result = build_step_loss_mask(
                ids, steps, text=text, offsets=offsets, tools=self.tools, open_tag=self.open_tag,
                close_tag=self.close_tag,
            )  # fmt: skip
            verdicts.extend(result.verdicts)
            masks.append(result.mask.tolist())
        self.last_counts = count_reasons(verdicts)
        return masks

    def _extra_steps(self, text: str, index: int, num_tokens: int) -> list[dict[str, Any]]:
        """`extra_steps`' steps of completion `index` (None: none), each checked, the error naming the call."""
        where = f"extra_steps(text, {index})"
        steps = self.extra_steps(text, index)
        if steps is None:
            return []
        if isinstance(steps, (str, bytes, Mapping)) or not isinstance(steps, Sequence):
            raise StepSpanError(f"{where} returned {steps!r:.80}; return a list of step dicts (or None for none).")
        for j, step in enumerate(steps):
            check_step(step, f"{where}[{j}]", num_tokens, text)
        return list(steps)

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
        out = {"step_mask/steps": float(total)}
        invalid = total - self.last_counts.get("ok", 0)
        out["step_mask/frac_invalid_steps"] = invalid / total if total else 0.0
        for reason, count in self.last_counts.items():
            if reason != "ok":
                out[f"step_mask/{reason}"] = float(count)
        return out


def apply_step_mask(
    completion_mask: torch.Tensor, completion_ids: torch.Tensor, tokenizer: Any, masker: CompletionStepMasker
) -> torch.Tensor:
    """`completion_mask` with the tokens of invalid steps set to 0 (same dtype and device)."""
    keep = masker.keep_mask(completion_ids, completion_mask, tokenizer)
    return (completion_mask * keep.to(completion_mask.dtype)).to(completion_mask.dtype)
