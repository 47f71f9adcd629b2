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
from dataclasses import dataclass, field

from trl_stable.masking.token_offsets import decode_response, token_char_offsets  # noqa: F401  (re-exported)

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


def _find_words(span: str, text: str) -> list[tuple[int, int]]:
    """Matches of the words of `span` with any punctuation or space between them ("kill you bitch" finds
    "kill you, bitch"; "awful film ." finds "awful film!")."""
    words = re.findall(r"\w+", span)
    if not words:
        return []
    pattern = re.compile(r"(?<!\w)" + r"\W+".join(re.escape(w) for w in words) + r"(?!\w)", re.IGNORECASE)
    return [(m.start(), m.end()) for m in pattern.finditer(text)]


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
    commentary), then as its words with any punctuation between them (critics drop or add commas).

    Example:
        >>> locate_span("The film, the  Film!", "the film")
        [(0, 8), (10, 19)]
    """
    found = _find_all(span, text)
    for forms in _looser_forms(span) if lenient and not found else []:
        found = [r for form in forms if form != span for r in _find_all(form, text)]
        if found:
            break
    if lenient and not found:
        found = _find_words(span, text)
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


MATCHED, PARTIAL, QUERY_ONLY, UNMATCHED = "matched", "partial", "query_only", "unmatched"


@dataclass
class SpanAlignment:
    """Where one critic span lies in the response.

    Attributes:
        span: The span as the critic wrote it.
        ranges: Its character ranges inside the response (cut at the response start for a span that begins in the
            query).
        status: ``"matched"`` (an occurrence lies wholly in the response), ``"partial"`` (found only across the
            query/response boundary: its response part is rewarded), ``"query_only"`` (found only in the query:
            nothing is rewarded) or ``"unmatched"`` (not found).
        fuzzy: Whether it was found by fuzzy matching (then `similarity` < 1 is rapidfuzz's score / 100).
    """

    span: str
    ranges: list[tuple[int, int]] = field(default_factory=list)
    status: str = UNMATCHED
    fuzzy: bool = False
    similarity: float = 1.0


def import_rapidfuzz():
    try:
        from rapidfuzz import fuzz
    except ImportError as exc:  # an optional extra: only fuzzy matching needs it
        raise ImportError(
            "Fuzzy span matching (fuzzy_span_matching=True) needs rapidfuzz: pip install 'trl_stable[fuzzy]' "
            "(or pip install rapidfuzz)."
        ) from exc
    return fuzz


# Shorter spans are too easily "similar" to a piece of some other word ("is" to "this").
FUZZY_MIN_SPAN_CHARS = 4


def fuzzy_locate(text: str, span: str, min_similarity: float) -> tuple[int, int, float] | None:
    """The stretch of `text` most similar to `span`, widened to whole words, as (start, end, similarity in [0, 1]);
    None below `min_similarity` or for spans of fewer than `FUZZY_MIN_SPAN_CHARS` word characters.

    The similarity is rapidfuzz's ``partial_ratio`` (normalized Indel similarity of `span` and the best window of
    `text` of its length), case-insensitive.
    """
    if len(re.sub(r"\W", "", span)) < FUZZY_MIN_SPAN_CHARS or not text:
        return None
    fuzz = import_rapidfuzz()
    a, b = span.strip().lower(), text.lower()
    if len(b) != len(text):  # lower() changed the length (rare Unicode): compare as written, offsets stay right
        a, b = span.strip(), text
    hit = fuzz.partial_ratio_alignment(a, b, score_cutoff=100.0 * min_similarity)
    if hit is None:
        return None
    start, end = hit.dest_start, hit.dest_end
    while start > 0 and text[start - 1].isalnum() and text[start].isalnum():
        start -= 1
    while end < len(text) and text[end].isalnum() and text[end - 1].isalnum():
        end += 1
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return (start, end, hit.score / 100.0) if end > start else None


def align_span(text: str, span: str, context: str = "", fuzzy_min_similarity: float | None = None) -> SpanAlignment:
    """Locate `span` in ``context + text`` (the query and the response, as the critic read them) and keep the
    response part.

    Exact matching first (`locate_span`: case, whitespace, apostrophes and end punctuation do not matter); a span
    still not found is matched fuzzily when `fuzzy_min_similarity` is set (`fuzzy_locate`, needs rapidfuzz).

    Example:
        >>> align_span(" awful film", "truly awful film", context="It was truly").status
        'partial'
    """
    full = context + text
    k = len(context)
    found = locate_span(full, span)
    result = SpanAlignment(span=span)
    if not found and fuzzy_min_similarity is not None:
        hit = fuzzy_locate(full, span, fuzzy_min_similarity)
        if hit is not None:
            found, result.fuzzy, result.similarity = [hit[:2]], True, hit[2]
    result.ranges = [(max(a, k) - k, b - k) for a, b in found if b > k]
    if any(a >= k for a, _ in found):
        result.status = MATCHED
    elif result.ranges:
        result.status = PARTIAL
    elif found:
        result.status = QUERY_ONLY
    return result


def align_spans(
    text: str, spans: Iterable[str], context: str = "", fuzzy_min_similarity: float | None = None
) -> list[SpanAlignment]:
    """`align_span` of each of `spans`."""
    return [align_span(text, s, context, fuzzy_min_similarity) for s in spans]


def rewards_from_alignments(
    offsets: Offsets,
    positive: Iterable[SpanAlignment],
    negative: Iterable[SpanAlignment],
    positive_value: float = 0.5,
    negative_value: float = -0.5,
    outside_value: float = 0.0,
) -> list[float]:
    """Per-token rewards from aligned spans (the formula of `span_token_rewards`)."""
    pos = _overlap_mask(offsets, [r for a in positive for r in a.ranges])
    neg = _overlap_mask(offsets, [r for a in negative for r in a.ranges])
    return [positive_value * p + negative_value * n + outside_value * (not (p or n)) for p, n in zip(pos, neg)]


def span_token_rewards(
    text: str,
    offsets: Offsets,
    positive_spans: Iterable[str],
    negative_spans: Iterable[str],
    positive_value: float = 0.5,
    negative_value: float = -0.5,
    outside_value: float = 0.0,
    *,
    context: str = "",
    fuzzy_min_similarity: float | None = None,
) -> list[float]:
    """Per-token intrinsic rewards of a response from the critic's spans.

    For token t with characters [s_t, e_t) of `text`:

        r_t = positive_value * [t overlaps a located positive span]
            + negative_value * [t overlaps a located negative span]
            + outside_value  * [t overlaps no located span]

    Spans are located with `align_span` in ``context + text`` (case-insensitive, whitespace-normalised, word
    boundaries, every occurrence; fuzzily when `fuzzy_min_similarity` is set), and only the response tokens they
    cover are rewarded: a span that starts in the query rewards its response part. A span that does not occur
    rewards nothing. A token that overlaps several spans of one polarity gets that polarity's value once (RELC's
    rule: a token is either "in a span" or not); both polarities add. `outside_value` also goes to tokens without
    characters (EOS), as RELC gave its "not in a span" value to every token.

    Args:
        text: The response text (only its tokens are rewarded).
        offsets: (start, end) character offsets of each response token within `text`; see `token_char_offsets`.
        positive_spans: Spans the critic marked good.
        negative_spans: Spans the critic marked bad (toxic, negative, wrong).
        positive_value: Reward of a token inside a positive span.
        negative_value: Reward of a token inside a negative span.
        outside_value: Reward of a token inside no span (RELC's toxicity/summarization ``positive_reward_value``).
        context: The text the critic read before the response (the query), to locate spans that start there.
        fuzzy_min_similarity: Similarity floor in (0, 1] for fuzzy matching of spans not found as written; None
            (default): exact matching only.

    Returns:
        One float per entry of `offsets`.
    """
    return rewards_from_alignments(
        offsets,
        align_spans(text, positive_spans, context, fuzzy_min_similarity),
        align_spans(text, negative_spans, context, fuzzy_min_similarity),
        positive_value,
        negative_value,
        outside_value,
    )
