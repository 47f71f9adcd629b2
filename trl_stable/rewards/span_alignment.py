"""Align critic spans with response tokens by character offsets.

A critic names text spans ("Identified Positive Text Span: [Span 1]: great acting"). Each span is located inside
the response text (case-insensitively, whitespace-normalised, at word boundaries, every occurrence), and a token gets
the span's value when its characters overlap a located span. This replaces RELC's substring test
``token in span`` (Cao et al., "Enhancing RL with Dense Rewards from Language Model Critic", EMNLP 2024), under which
a token such as "the" matched any span containing those letters and a leading-space token (" great") never matched the
span's first word.
"""

from __future__ import annotations

import bisect
import os
import re
from collections.abc import Iterable, Sequence
from typing import Any

Offsets = Sequence[tuple[int, int]]


_APOSTROPHES = "'\u2018\u2019`"
_EDGE_PUNCT_RE = re.compile(r"^\W+|\W+$")
_PART_SPLIT_RE = re.compile(r"\s*[,;]\s*|\s+[-\u2013\u2014]+\s+")


def _word_regex(word: str) -> str:
    # Critics retype apostrophes ("don't" for "don’t"); every apostrophe form matches every other.
    return "".join(f"[{_APOSTROPHES}]" if ch in _APOSTROPHES else re.escape(ch) for ch in word)


def _span_pattern(span: str) -> re.Pattern | None:
    """Regex for `span`: words separated by any whitespace run, anchored at word boundaries where the span has them."""
    words = span.split()
    if not words:
        return None
    body = r"\s+".join(_word_regex(w) for w in words)
    # A boundary is only required on a side that starts/ends with a word character: a span such as "!!" or "-ish"
    # carries no word there, and demanding one would make it unlocatable.
    left = r"(?<!\w)" if re.match(r"\w", words[0]) else ""
    right = r"(?!\w)" if re.search(r"\w$", words[-1]) else ""
    return re.compile(left + body + right, re.IGNORECASE)


def _find_all(span: str, text: str) -> list[tuple[int, int]]:
    """Every match of `span` in `text`, overlapping ones included ("ha ha" occurs twice in "ha ha ha")."""
    pattern = _span_pattern(span)
    found: list[tuple[int, int]] = []
    pos = 0
    while pattern is not None and (m := pattern.search(text, pos)) is not None:
        found.append((m.start(), m.end()))
        pos = m.start() + 1
    return found


def _looser_forms(span: str) -> list[list[str]]:
    """Fallbacks for a span the text does not contain, in order: without the punctuation at its ends ("wow!" ->
    "wow"), then its parts around commas, semicolons and spaced dashes ("idiot - an insult" -> "idiot", ...)."""
    parts = [_EDGE_PUNCT_RE.sub("", p) for p in _PART_SPLIT_RE.split(span)]
    return [[_EDGE_PUNCT_RE.sub("", span)], [p for p in parts if p] if len(parts) > 1 else []]


def locate_span(text: str, span: str, lenient: bool = True) -> list[tuple[int, int]]:
    """Every (start, end) character range of `span` inside `text`.

    Matching is case-insensitive, treats any whitespace run as equal to any other and any apostrophe as equal to any
    other, and requires word boundaries at the span's ends (so "the" is not found inside "there"). Every occurrence
    counts, overlapping ones included. With `lenient`, a span that does not occur as written is retried without the
    punctuation at its ends, then as its comma/semicolon/dash-separated parts (critics add punctuation and
    commentary).

    Example:
        >>> locate_span("The film, the  Film!", "the film")
        [(0, 8), (10, 19)]
    """
    found = _find_all(span, text)
    for forms in _looser_forms(span) if lenient and not found else []:
        found = [r for form in forms if form != span for r in _find_all(form, text)]
        if found:
            break
    return sorted(found)


def locate_spans(text: str, spans: Iterable[str]) -> list[tuple[int, int]]:
    """The located ranges of all `spans` in `text` (concatenated; ranges of different spans may overlap)."""
    return [r for span in spans for r in locate_span(text, span)]


def _union(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint ranges covering the same characters as `ranges`."""
    merged: list[list[int]] = []
    for a, b in sorted(ranges):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _overlap_mask(offsets: Offsets, ranges: Iterable[tuple[int, int]]) -> list[bool]:
    """Whether each token [s, e) overlaps some range; O((tokens + ranges) log ranges)."""
    merged = _union(ranges)
    starts = [a for a, _ in merged]
    mask = []
    for start, end in offsets:
        k = bisect.bisect_left(starts, end) - 1  # the last range starting before the token ends reaches furthest
        # Empty tokens (special tokens, offsets (i, i)) carry no characters and so lie in no span.
        mask.append(end > start and k >= 0 and merged[k][1] > start)
    return mask


def span_token_rewards(
    text: str,
    offsets: Offsets,
    positive_spans: Iterable[str],
    negative_spans: Iterable[str],
    positive_value: float = 0.5,
    negative_value: float = -0.5,
) -> list[float]:
    """Per-token intrinsic rewards of a response from the critic's spans.

    For token t with characters [s_t, e_t) of `text`:

        r_t = positive_value * [t overlaps a located positive span]
            + negative_value * [t overlaps a located negative span]

    Spans are located with `locate_span` (case-insensitive, whitespace-normalised, word boundaries, every occurrence).
    A span that does not occur in `text` rewards nothing. A token that overlaps several spans of one polarity gets
    that polarity's value once (RELC's rule: a token is either "in a span" or not); both polarities add.

    Args:
        text: The response text (only the response: words of the prompt must not be rewarded).
        offsets: (start, end) character offsets of each response token within `text`; see `token_char_offsets`.
        positive_spans: Spans the critic marked good.
        negative_spans: Spans the critic marked bad (toxic, negative, wrong).
        positive_value: Reward of a token inside a positive span.
        negative_value: Reward of a token inside a negative span.

    Returns:
        One float per entry of `offsets`.
    """
    pos = _overlap_mask(offsets, locate_spans(text, positive_spans))
    neg = _overlap_mask(offsets, locate_spans(text, negative_spans))
    return [positive_value * p + negative_value * n for p, n in zip(pos, neg)]


def decode_response(tokenizer: Any, ids: Sequence[int]) -> str:
    """The response text the offsets refer to: special tokens dropped, no clean-up of tokenization spaces."""
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=True, clean_up_tokenization_spaces=False)


def _incremental_offsets(tokenizer: Any, ids: Sequence[int], text: str) -> list[tuple[int, int]]:
    """Offsets by decoding growing prefixes: token i covers what decoding ids[:i+1] adds to decoding ids[:i].

    Byte-level tokenizers can split one character over several tokens; a prefix that ends mid-character decodes to a
    trailing U+FFFD. Only the part of a prefix that agrees with the full text counts as decoded. A token covers the
    characters from the first one not complete before it (possibly one it finishes) up to the last one it touches,
    including a character it only starts, so a span over that character reaches every token holding its bytes.
    """
    offsets = []
    complete = 0  # characters fully decoded so far
    for i in range(len(ids)):
        prefix = decode_response(tokenizer, ids[: i + 1])
        common = len(os.path.commonprefix([prefix, text]))
        now_complete = max(complete, common)
        starts_next = len(prefix) > common and now_complete < len(text)  # trailing bytes of an unfinished char
        offsets.append((complete, now_complete + 1 if starts_next else now_complete))
        complete = now_complete
    return offsets


def _stream_offsets(tokenizer: Any, ids: Sequence[int], text: str) -> list[tuple[int, int]] | None:
    """Offsets in one pass with the `tokenizers` streaming decoder (same rules as `_incremental_offsets`).

    Returns None when the stream's text differs from `text` (decoders with clean-up or prefix-space rules), so the
    caller falls back to the quadratic prefix decoding.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=True)
        chunks = [stream.step(backend, int(i)) for i in ids]
    except Exception:  # noqa: BLE001 - an old `tokenizers` or an unusual backend: use the fallback
        return None
    offsets: list[tuple[int, int]] = []
    first_pending = 0  # first token of the run that the next chunk completes
    pos = 0
    for k, chunk in enumerate(chunks):
        if chunk is None:  # this token ends inside a multi-byte character
            continue
        start, pos = pos, pos + len(chunk)
        offsets.extend(_run_offsets(tokenizer, ids[first_pending : k + 1], chunk, start))
        first_pending = k + 1
    streamed = "".join(c for c in chunks if c is not None)
    tail = text[len(streamed) :]
    if not text.startswith(streamed) or tail.strip("\ufffd"):
        return None
    offsets.extend([(pos, len(text))] * (len(ids) - first_pending))  # bytes left incomplete at the end (U+FFFD)
    return offsets


def _run_offsets(tokenizer: Any, run: Sequence[int], chunk: str, start: int) -> list[tuple[int, int]]:
    """Offsets of a run of tokens whose text the stream emitted at once (`chunk`, at `start`): the run's tokens but
    the last left a character incomplete, so the split inside `chunk` comes from prefix decoding of the run alone."""
    if len(run) == 1:
        return [(start, start + len(chunk))]
    if decode_response(tokenizer, run) == chunk:
        return [(start + a, start + b) for a, b in _incremental_offsets(tokenizer, run, chunk)]
    # The run does not decode alone as in context (a decoder that strips a leading space): every token gets the
    # whole chunk, so no span over it is missed.
    return [(start, start + len(chunk))] * len(run)


def token_char_offsets(tokenizer: Any, completion_ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """Decode `completion_ids` and give each token its (start, end) character offsets in the decoded text.

    The text is ``tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)``; token i
    covers what decoding it adds to the text. Three ways, first that applies:

    1. the `tokenizers` streaming decoder (one pass; used when its text equals the decoded text);
    2. the tokenizer's own ``return_offsets_mapping`` on the re-encoded text, when re-encoding gives back exactly
       the sampled ids (a sampled completion need not be the canonical tokenisation of its text);
    3. decoding growing prefixes (quadratic, works for any tokenizer with `decode`).

    A token covers every character it holds a byte of (byte-level BPE splits characters). Special tokens (EOS, pad)
    get empty offsets.

    Returns:
        `(text, offsets)` with ``len(offsets) == len(completion_ids)``.
    """
    ids = [int(i) for i in completion_ids]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    keep = [k for k, i in enumerate(ids) if i not in special]
    kept_ids = [ids[k] for k in keep]
    text = decode_response(tokenizer, kept_ids)
    kept_offsets = _stream_offsets(tokenizer, kept_ids, text) if kept_ids else []
    if kept_offsets is None and getattr(tokenizer, "is_fast", False):
        try:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError):
            enc = None
        if enc is not None and list(enc["input_ids"]) == kept_ids:
            mapped = [(int(s), int(e)) for s, e in enc["offset_mapping"]]
            # Some tokenizers report offsets without the leading space of a word; the span overlap test is
            # unaffected, but offsets must stay inside the text.
            if all(0 <= s <= e <= len(text) for s, e in mapped):
                kept_offsets = mapped
    if kept_offsets is None:
        kept_offsets = _incremental_offsets(tokenizer, kept_ids, text)
    offsets: list[tuple[int, int]] = []
    it = iter(kept_offsets)
    cursor = 0
    keep_set = set(keep)
    for k in range(len(ids)):
        if k in keep_set:
            off = next(it)
            cursor = off[1]
            offsets.append(off)
        else:
            offsets.append((cursor, cursor))
    return text, offsets
