"""Per-token loss masks from step boundaries (docs/agent_steps.md); a token straddling a boundary is masked when it
overlaps an invalid step at all."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trl_stable.masking.token_offsets import char_span_to_tokens, encode_with_offsets, token_char_offsets
from trl_stable.masking.validation import StepVerdict, normalize_signatures, validate_step


@dataclass
class StepMask:
    """The result of `build_step_loss_mask`: the float `mask` (T,) (1 trains, 0 masked) and one `StepVerdict` per
    step, in the order given."""

    mask: torch.Tensor
    verdicts: list[StepVerdict] = field(default_factory=list)

    @property
    def num_invalid_steps(self) -> int:
        return sum(not v.valid for v in self.verdicts)


class StepSpanError(ValueError):
    """A step whose boundaries are not a span of the sequence: not a dict, a missing or non-integer start or end,
    end before start, an unknown unit, or a span beyond the text or the tokens."""


_STEP_FIX = (
    'each step is a dict {"start": int, "end": int, "unit": "token" or "char", "type": str} with 0 <= start <= end '
    "<= the sequence's length in its unit ([start, end))"
)


def check_steps(steps: Any, name: str, num_tokens: int, text: str | None, returned: bool = False) -> None:
    """Raise `StepSpanError` naming `name` (``steps``, or the call that `returned` them) and the step unless `steps` is
    a list of spans of a sequence of `num_tokens` tokens (``unit="token"``, the default) or of `text`'s characters
    (``unit="char"``)."""
    if isinstance(steps, (str, bytes, Mapping)) or not isinstance(steps, Sequence):
        if returned:
            raise StepSpanError(f"{name} returned {steps!r:.80}; return a list of step dicts (or None for none).")
        raise StepSpanError(f"{name} is {steps!r:.80}; pass a list of step dicts.")
    for i, step in enumerate(steps):
        where = f"{name}[{i}]"
        if not isinstance(step, Mapping):
            raise StepSpanError(f"{where} is {step!r:.80} ({type(step).__name__}); {_STEP_FIX}.")
        bounds = [step.get(key) for key in ("start", "end")]
        if not all(isinstance(b, numbers.Integral) and not isinstance(b, bool) for b in bounds):
            raise StepSpanError(f"{where} has start={bounds[0]!r}, end={bounds[1]!r}; {_STEP_FIX}.")
        unit = step.get("unit") or "token"
        if unit not in ("token", "char"):
            raise StepSpanError(f"{where} has unit={unit!r}; {_STEP_FIX}.")
        length = num_tokens if unit == "token" else None if text is None else len(text)
        start, end = int(bounds[0]), int(bounds[1])
        if not 0 <= start <= end or (length is not None and end > length):
            of = "the sequence" if length is None else f"the sequence's {length} {unit}s"
            raise StepSpanError(f"{where} is [{start}, {end}) in {unit}s, not a span of {of}; {_STEP_FIX}.")


def decode_offsets(tokenizer: Any, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """The decoded text of `ids`, special tokens kept (a step marker can be one), and each token's character span
    in it: `trl_stable.masking.token_offsets.token_char_offsets`. Used where only ids are known (RL completions)."""
    return token_char_offsets(tokenizer, ids, skip_special_tokens=False)


def build_step_loss_mask(
    input_ids: Sequence[int] | torch.Tensor,
    steps: Sequence[Mapping[str, Any]],
    tokenizer: Any = None,
    text: str | None = None,
    offsets: Sequence[Sequence[int]] | None = None,
    tools: Mapping[str, Any] | Sequence[Any] | None = None,
    outside_steps: float = 1.0,
    open_tag: str = "<tool_call>",
    close_tag: str = "</tool_call>",
) -> StepMask:
    """Build the per-token SFT/RL loss mask of one sequence from its steps.

    Args:
        input_ids: The sequence's token ids (T,).
        steps: Step dicts: ``[start, end)`` in ``unit`` ("token"/"char"), ``type``, ``metadata`` (`validate_step`).
        tokenizer: Needed for character steps without `offsets` (then `text` must tokenize back to `input_ids`), and
            to decode token steps without `text`.
        text, offsets: The sequence's text and each token's character span in it.
        tools: Valid tools (names, ``{name: schema}`` or OpenAI specs); None skips the name/argument checks.
        outside_steps: Mask value of tokens covered by no step (1: train them; 0: train only on valid steps).
    """
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else [int(i) for i in input_ids]
    n = len(ids)
    check_steps(steps, "steps", n, text)
    signatures = normalize_signatures(tools) if tools is not None else None
    if any((step.get("unit") or "token") == "char" for step in steps) and offsets is None:
        if text is None or tokenizer is None:
            raise ValueError("Character-offset steps need `text` and either `offsets` or a fast `tokenizer`.")
        enc_ids, offsets = encode_with_offsets(tokenizer, text)
        if enc_ids != ids:
            raise ValueError(
                "Tokenizing `text` does not reproduce `input_ids`, so character offsets cannot be mapped to tokens. "
                "Pass `offsets` for `input_ids`, or build `input_ids` by tokenizing `text` without special tokens."
            )
    if offsets is not None and len(offsets) != n:
        raise ValueError(f"`offsets` has {len(offsets)} entries for {n} tokens; they must align one to one.")

    mask = torch.full((n,), float(outside_steps))
    invalid = torch.zeros(n, dtype=torch.bool)
    verdicts: list[StepVerdict] = []
    for step in steps:
        start, end = int(step["start"]), int(step["end"])
        if (step.get("unit") or "token") == "char":
            step_text = text[start:end] if text is not None else None
            t0, t1 = char_span_to_tokens(offsets, start, end)
        else:
            t0, t1 = start, end
            if text is not None and offsets is not None and t1 > t0:
                step_text = text[offsets[t0][0] : offsets[t1 - 1][1]]
            elif tokenizer is not None:
                step_text = tokenizer.decode(ids[t0:t1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            else:
                step_text = None
        verdict = validate_step(step, step_text, signatures, open_tag, close_tag)
        verdicts.append(verdict)
        if verdict.valid:
            mask[t0:t1] = 1.0
        else:
            invalid[t0:t1] = True
    mask[invalid] = 0.0
    return StepMask(mask=mask, verdicts=verdicts)
