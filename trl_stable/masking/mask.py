"""Per-token loss masks from step boundaries (docs/agent_steps.md).

A sequence is split into steps ``{"start", "end", "type", "metadata"}``; boundaries are token indices
(``"unit": "token"``, the default) or character offsets into the sequence's text (``"unit": "char"``), mapped to
tokens through the tokenizer's offsets. A token gets mask 0 when it overlaps an invalid step (see
`trl_stable.masking.validation`); tokens of valid steps get 1, and tokens outside every step get `outside_steps`
(1 by default: only invalid steps are removed).

A token that straddles a step boundary (byte-level BPE merges across it, e.g. ``"}\\n"``) is masked when it
overlaps an invalid step at all: a token that carries part of a broken call must not be trained on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from trl_stable.masking.validation import StepVerdict, normalize_signatures, validate_step


@dataclass
class StepMask:
    """The result of `build_step_loss_mask`.

    Attributes:
        mask: float tensor (T,), 1 = trains, 0 = masked.
        verdicts: one `StepVerdict` per step, in the order given.
        token_spans: per step, the ``[start, end)`` token range it covers.
    """

    mask: torch.Tensor
    verdicts: list[StepVerdict] = field(default_factory=list)
    token_spans: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_invalid_steps(self) -> int:
        return sum(not v.valid for v in self.verdicts)


def token_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of `text` (no special tokens added), from a fast tokenizer."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def char_span_to_tokens(offsets: Sequence[Sequence[int]], start: int, end: int) -> tuple[int, int]:
    """The token range ``[first, last)`` whose character offsets overlap ``[start, end)``.

    Overlap, not containment: a token that straddles the boundary belongs to the step. Empty when no token
    overlaps (``first == last``).
    """
    hits = [k for k, (a, b) in enumerate(offsets) if a < end and b > start and b > a]
    return (hits[0], hits[-1] + 1) if hits else (0, 0)


def decode_offsets(tokenizer: Any, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """The decoded text of `ids` and each token's character span in it.

    Offsets come from decoding growing prefixes. A multi-byte character split across byte-level tokens belongs to
    every token carrying one of its bytes (as in a fast tokenizer's own offsets), so a step that starts with such a
    character also masks the tokens holding its first bytes. Used where only ids are known (RL completions).
    """
    ids = [int(i) for i in ids]
    kwargs = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
    pieces = [tokenizer.decode([i], **kwargs) for i in ids]
    full = tokenizer.decode(ids, **kwargs)
    if "".join(pieces) == full:  # the common case: tokens decode independently, O(T)
        offsets, pos = [], 0
        for piece in pieces:
            offsets.append((pos, pos + len(piece)))
            pos += len(piece)
        return full, offsets
    offsets: list[tuple[int, int]] = []
    pending: list[int] = []  # tokens whose bytes start a character that is not complete yet
    prev = 0
    text = ""
    for k in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:k], **kwargs)
        # A prefix that ends inside a multi-byte character decodes to a replacement char that later vanishes.
        cur = max(len(text.rstrip("\ufffd")), prev)
        offsets.append((prev, cur))
        if text.endswith("\ufffd"):
            pending.append(k - 1)
        else:
            for p in pending:  # they carry bytes of the characters this token completes
                offsets[p] = (offsets[p][0], cur)
            pending = []
        prev = cur
    return text, offsets


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
        steps: Step dicts: ``start``/``end`` (``[start, end)``), ``unit`` ("token" or "char"), ``type``, and
            ``metadata`` (see `validate_step` for the keys read).
        tokenizer: Needed for character steps without `offsets`, and to decode token steps without `text`.
        text: The sequence's text; character steps index into it. With `tokenizer` and no `offsets`, it is
            tokenized and must give `input_ids` back (else ValueError: the offsets would be misaligned).
        offsets: Per-token character offsets of `text` (as from ``return_offsets_mapping=True``).
        tools: Valid tools (names, ``{name: schema}`` or OpenAI specs); None skips the name/argument checks.
        outside_steps: Mask value of tokens covered by no step (1: train them; 0: train only on valid steps).

    Returns:
        A `StepMask` with the mask (float, length T), one verdict per step and each step's token range.
    """
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else [int(i) for i in input_ids]
    n = len(ids)
    signatures = normalize_signatures(tools) if tools is not None else None
    if any((step.get("unit") or "token") == "char" for step in steps) and offsets is None:
        if text is None or tokenizer is None:
            raise ValueError("Character-offset steps need `text` and either `offsets` or a fast `tokenizer`.")
        enc_ids, offsets = token_offsets(tokenizer, text)
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
    spans: list[tuple[int, int]] = []
    for step in steps:
        start, end = int(step["start"]), int(step["end"])
        if end < start:
            raise ValueError(f"Step {dict(step)!r} has end < start.")
        if (step.get("unit") or "token") == "char":
            step_text = text[start:end] if text is not None else None
            t0, t1 = char_span_to_tokens(offsets, start, end)
        else:
            if not 0 <= start <= end <= n:
                raise ValueError(f"Token step [{start}, {end}) lies outside the sequence of {n} tokens.")
            t0, t1 = start, end
            if text is not None and offsets is not None and t1 > t0:
                step_text = text[offsets[t0][0] : offsets[t1 - 1][1]]
            elif tokenizer is not None:
                step_text = tokenizer.decode(ids[t0:t1], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            else:
                step_text = None
        verdict = validate_step(step, step_text, signatures, open_tag, close_tag)
        verdicts.append(verdict)
        spans.append((t0, t1))
        if verdict.valid:
            mask[t0:t1] = 1.0
        else:
            invalid[t0:t1] = True
    mask[invalid] = 0.0
    return StepMask(mask=mask, verdicts=verdicts, token_spans=spans)
