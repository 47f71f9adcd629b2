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
import re
from collections.abc import Iterable, Sequence

from trl_stable.token_offsets import decode_response, token_char_offsets  # noqa: F401  (re-exported)

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
