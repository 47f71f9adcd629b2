"""Character offsets of tokens, one implementation for critic spans on response tokens (`trl_stable.rewards.critic`)
and agent steps in characters (`trl_stable.masking`): `encode_with_offsets` when the text is known (SFT data),
`token_char_offsets` when only the ids are (sampled RL completions, not always the canonical tokenization)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any


def encode_with_offsets(tokenizer: Any, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of `text` (no special tokens added), from a fast tokenizer."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def char_span_to_tokens(offsets: Sequence[Sequence[int]], start: int, end: int) -> tuple[int, int]:
    """The token range ``[first, last)`` whose character offsets overlap ``[start, end)``, ``(0, 0)`` for none;
    empty-offset tokens (special tokens) never overlap."""
    hits = [k for k, (a, b) in enumerate(offsets) if a < end and b > start and b > a]
    return (hits[0], hits[-1] + 1) if hits else (0, 0)


def decode_response(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """The text the offsets refer to: the decoded ids without clean-up of tokenization spaces."""
    return tokenizer.decode(
        [int(i) for i in ids], skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


def _incremental_offsets(tokenizer: Any, ids: Sequence[int], text: str, skip: bool = True) -> list[tuple[int, int]]:
    """Offsets by decoding growing prefixes: token i covers what decoding ids[:i+1] adds to ids[:i], where only the
    part of a prefix that agrees with the full text counts (a prefix ending mid-character decodes to U+FFFD), plus a
    character it only starts, so a span over that character reaches every token holding its bytes."""
    offsets = []
    complete = 0  # characters fully decoded so far
    for i in range(len(ids)):
        prefix = decode_response(tokenizer, ids[: i + 1], skip)
        common = len(os.path.commonprefix([prefix, text]))
        now_complete = max(complete, common)
        starts_next = len(prefix) > common and now_complete < len(text)  # trailing bytes of an unfinished char
        offsets.append((complete, now_complete + 1 if starts_next else now_complete))
        complete = now_complete
    return offsets


def _stream_offsets(tokenizer: Any, ids: Sequence[int], text: str, skip: bool = True) -> list[tuple[int, int]] | None:
    """Offsets in one pass with the `tokenizers` streaming decoder (rules of `_incremental_offsets`); None when the
    stream's text differs from `text` (decoders with clean-up or prefix-space rules)."""
    try:
        from tokenizers.decoders import DecodeStream

        backend = tokenizer.backend_tokenizer
        stream = DecodeStream(skip_special_tokens=skip)
        chunks = [stream.step(backend, int(i)) for i in ids]
    except Exception:  # noqa: BLE001 - a slow tokenizer, an old `tokenizers` or an unusual backend: the fallback
        return None
    offsets: list[tuple[int, int]] = []
    first_pending = 0  # first token of the run that the next chunk completes
    pos = 0
    for k, chunk in enumerate(chunks):
        if chunk is None:  # this token ends inside a multi-byte character
            continue
        start, pos = pos, pos + len(chunk)
        # The run of tokens the chunk completes: all but the last left a character incomplete, so the split inside the
        # chunk comes from prefix decoding of the run alone; a run that does not decode alone as in context (a
        # decoder that strips a leading space) gives every token the whole chunk, so no span over it is missed.
        run = ids[first_pending : k + 1]
        if len(run) > 1 and decode_response(tokenizer, run, skip) == chunk:
            offsets.extend((start + a, start + b) for a, b in _incremental_offsets(tokenizer, run, chunk, skip))
        else:
            offsets.extend([(start, pos)] * len(run))
        first_pending = k + 1
    streamed = "".join(c for c in chunks if c is not None)
    if not text.startswith(streamed) or text[len(streamed) :].strip("\ufffd"):
        return None
    offsets.extend([(pos, len(text))] * (len(ids) - first_pending))  # bytes left incomplete at the end (U+FFFD)
    return offsets


def token_char_offsets(
    tokenizer: Any, completion_ids: Sequence[int], skip_special_tokens: bool = True
) -> tuple[str, list[tuple[int, int]]]:
    """Decode `completion_ids` and give each token its (start, end) character offsets in the decoded text.

    The text is ``decode_response``'s; token i covers every character it holds a byte of, skipped special tokens
    (EOS, pad) nothing. The first way that applies: the `tokenizers` streaming decoder (one pass), the fast
    tokenizer's offsets when re-encoding the text gives back exactly these ids, decoding growing prefixes (quadratic).

    Returns:
        `(text, offsets)` with ``len(offsets) == len(completion_ids)``.
    """
    ids = [int(i) for i in completion_ids]
    skip = skip_special_tokens
    special = set(getattr(tokenizer, "all_special_ids", []) or []) if skip else set()
    kept_ids = [i for i in ids if i not in special]
    text = decode_response(tokenizer, kept_ids, skip)
    kept_offsets = _stream_offsets(tokenizer, kept_ids, text, skip) if kept_ids else []
    if kept_offsets is None and getattr(tokenizer, "is_fast", False):
        try:
            enc_ids, mapped = encode_with_offsets(tokenizer, text)
        except (NotImplementedError, ValueError, TypeError):
            enc_ids = None
        # Some tokenizers report offsets without the leading space of a word; the span overlap test is unaffected,
        # but offsets must stay inside the text.
        if enc_ids == kept_ids and all(0 <= s <= e <= len(text) for s, e in mapped):
            kept_offsets = mapped
    if kept_offsets is None:
        kept_offsets = _incremental_offsets(tokenizer, kept_ids, text, skip)
    offsets, kept, cursor = [], iter(kept_offsets), 0
    for i in ids:  # a skipped special token: empty, where the text stands after the tokens before it
        offsets.append(next(kept) if i not in special else (cursor, cursor))
        cursor = offsets[-1][1]
    return text, offsets
