"""Parse critic answers into positive and negative text spans: the sentiment, toxicity and summarization formats of
Drlc/RELC (Cao et al., EMNLP 2024, arXiv 2401.07382) and of our templates, wrapped in prose, numbered, quoted, or
continuing a header the prompt ended with (docs/critic_rewards.md, "Prompts")."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# The version of what this parser accepts. Disk-cache entries record it: an answer validated by another version is
# parsed again before it is served. Bump it when a change makes some answer parse (or stop parsing).
PARSER_VERSION = "2"

# Summarization labels. Negative keywords are tested first: "inaccurate", "irrelevant", "incorrect", "unfaithful" and
# "unsupported" contain a positive keyword.
NEGATIVE_LABEL_KEYWORDS = (
    "inaccura", "irrelevant", "incorrect", "unfaithful", "unsupported", "unnecessary", "unimportant", "bad", "wrong",
    "redundan", "hallucinat", "fabricat", "repetit", "repeat", "verbose", "error", "contradict", "negative", "remove",
    "ungrammatical", "off-topic", "false", "poor", "misleading", "vague", "incoheren", "non-factual", "nonfactual",
    "problem", "flaw", "misplaced",
)  # fmt: skip
POSITIVE_LABEL_KEYWORDS = (
    "good", "correct", "accura", "relevant", "key", "keep", "positive", "faithful", "important", "informative",
    "concise", "supported", "essential", "main point", "fluent",
)  # fmt: skip

_NONE_RE = re.compile(
    r"^\s*(?:none(?:\s+(?:identified|found|detected))?|n/?a|no(?:thing)?(?:\s+\w+)?\s*(?:identified|found|spans?)?"
    r"|no\s+(?:positive|negative|toxic)\s+(?:text\s+)?spans?(?:\s+(?:identified|found))?|-+)\s*[.!]?\s*$",
    re.IGNORECASE,
)
_HEADER_RE = re.compile(
    # RELC's headers without a polarity name bad spans: "Identified Text Span:" (its negative-only sentiment prompt),
    # "Toxic Spans Identified in the Sentence:", "Problematic Spans Identified in the Summary:".
    r"(?<!\w)(?P<neg>(?:toxic|problematic|flawed)\s+(?:text\s+)?spans?\s+identified(?:\s+in\s+the\s+\w+)?\s*:"
    r"|identified\s+(?:text\s+)?spans?\s*:)"
    r"|(?<!\w)identified\s+(?P<a>positive|negative)\s+(?:text\s+)?spans?\b\s*(?:\(s\))?\s*:?"
    r"|^[ \t*#>-]*(?P<b>positive|negative)(?:\s+(?:text\s+)?spans?)?\b\s*(?:\(s\))?\s*\**\s*:"
    r"|(?<!\w)(?<!no )(?P<toxic>toxic)\s+(?:text\s+)?spans?\b\s*(?:\[?\s*\d+\s*\]?)?\s*:?",
    re.IGNORECASE | re.MULTILINE,
)
# Any line ending in "(Label: ...)"; the numbering/marker before the span is removed by `clean_span`.
_LABELED_RE = re.compile(
    r"(?im)^[ \t*#>]*(?P<span>[^\n]*?)\s*[\(\[]\s*label\s*[:=]\s*(?P<label>[^)\]\n]*)[\)\]]\s*[.;,]?[ \t]*$"
)
_SPAN_MARKER_RE = re.compile(r"\[\s*span\s*\d+\s*\]\s*:?|(?<![\w])span\s*\d+\s*:", re.IGNORECASE)
_ITEM_PREFIX_RE = re.compile(r"^\s*(?:[-*\u2022]+|\d+\s*[.):]|\(\d+\))\s*")
# "Span 1: a (Label: good) Span 2: b (Label: bad)" on one line: each labelled span gets its own line.
_ONE_LINE_LABELS_RE = re.compile(r"(\(\s*label\s*[:=][^)\n]*\))[ \t.;,]*(?=(?:\[\s*)?span\s*\d+)", re.IGNORECASE)
_MARKED_LINE_RE = re.compile(
    r"^\s*(?:\[\s*span\s*\d+\s*\]|span\s*\d+\s*:|[-*\u2022]|\d+\s*[.):]|\(\d+\)|[\"\u201c'\u2018])", re.IGNORECASE
)
# "There are no toxic spans.", "The text is fine. None identified." - a valid, empty answer without a header.
_NONE_ANYWHERE_RE = re.compile(r"\bnone\s+identified\b|\bno\s+(?:\w+\s+){0,3}?spans?\b", re.IGNORECASE)
_NEGATOR_RE = re.compile(r"\b(?:not|no|non|never|lacks?|lacking|without|isn't|wasn't|doesn't)\b")
_TRAILING_NOTE_RE = re.compile(r"(?<=\S)\s+\([^()]*\)$")  # "idiot (insult)": commentary in parentheses
_PROSE_STOP_RE = re.compile(
    r"^\s*(?:(?:explanation|note|reason(?:ing)?|rationale|comments?|analysis|justification)s?\s*:"
    # RELC's prompt_summ_3shot.txt asks a question after the spans ("Is the summary missing key information?").
    r"|(?:is|are|does|do|did|was|were)\s+the\s+(?:summary|text|sentence|review)\b[^\n]*\?\s*$)",
    re.IGNORECASE,
)
_PROBLEM_HEADER_RE = re.compile(r"(?<!\w)(?:problematic|flawed)\s+spans?\b", re.IGNORECASE)
_QUOTED_RE = re.compile(r"\"([^\"]+)\"|\u201c([^\u201d]+)\u201d|'([^']+)'|\u2018([^\u2019]+)\u2019")
_QUOTES = "\"'`\u201c\u201d\u2018\u2019\u00ab\u00bb"
_LEADING_QUOTED_RE = re.compile(r"^[\"\u201c'\u2018](.+?)[\"\u201d'\u2019](?=\s|$|[.,;:!?(\-])")
_INLINE_NUMBER_RE = re.compile(r"(?:^|(?<=\s))\d{1,2}[.)]\s+")
_TRAILING = ".,;:!?" + _QUOTES


@dataclass
class ParsedCritique:
    """Spans read from one critic answer: `positive` (good), `negative` (bad, toxic, flawed); `ok` whether it had a
    recognisable structure ("None identified" is a valid, empty answer) and `reason` why not; `unknown_labels`
    (summarization labels neither good nor bad: their spans are dropped); `ignored_text`, span-like text before the
    first header that no header claimed (an answer continuing a header the parser was not told about)."""

    positive: list[str] = field(default_factory=list)
    negative: list[str] = field(default_factory=list)
    ok: bool = True
    reason: str = ""
    unknown_labels: list[str] = field(default_factory=list)
    ignored_text: str = ""


def clean_span(raw: str) -> str:
    """Strip numbering, span markers, surrounding quotes and trailing punctuation from one span; "" for none-like."""
    s = _ITEM_PREFIX_RE.sub("", raw.strip(), count=1).strip()  # "1. [Span 1]: x" and "[Span 1]: 1. x"
    s = _SPAN_MARKER_RE.sub(" ", s, count=1) if _SPAN_MARKER_RE.match(s) else s
    s = _ITEM_PREFIX_RE.sub("", s, count=1).strip()
    s = _TRAILING_NOTE_RE.sub("", s).strip()
    # Punctuation after closing quotes is never part of the span; inside them "!"/"?" are kept (they are located
    # as written), while a trailing comma or period is the critic's list punctuation.
    unquoted = s.rstrip(".,;:!?").strip()
    leading = _LEADING_QUOTED_RE.match(s)
    if len(unquoted) >= 2 and unquoted[0] in _QUOTES and unquoted[-1] in _QUOTES:
        s = unquoted[1:-1].strip().rstrip(".,;:").strip()
    elif leading:  # '"idiot" (an insult)': the quoted part is the span, the rest is commentary
        s = leading.group(1).strip().rstrip(".,;:").strip()
    else:
        s = s.strip(_QUOTES).strip().rstrip(_TRAILING).strip()
    return "" if not s or _NONE_RE.match(s) else s


def _section_lines(content: str) -> list[str]:
    """The lines of a section body that hold spans. The header's line is kept; a later line is commentary, ending
    the section, when it starts with "Explanation:"/"Note:"..., or carries no item marker (``[Span k]``, a bullet, a
    number, a quote) after a span on the header's line or after a blank line."""
    lines = content.splitlines() or [""]
    kept = [lines[0]]
    strict = bool(lines[0].strip())
    for line in lines[1:]:
        if _PROSE_STOP_RE.match(line):
            break
        if not line.strip():
            strict = strict or any(k.strip() for k in kept)
        elif strict and not _MARKED_LINE_RE.match(line):
            break
        else:
            kept.append(line)
    return kept


def _split_items(content: str) -> list[str]:
    """Spans of a section body: ``[Span k]:`` markers, else one per line; several quoted strings on a line split."""
    body = "\n".join(_section_lines(content))
    pieces = _SPAN_MARKER_RE.split(body) if _SPAN_MARKER_RE.search(body) else body.splitlines()
    items = []
    for piece in pieces:
        for line in piece.splitlines():
            if not line.strip():
                continue
            numbered = _INLINE_NUMBER_RE.findall(line)
            if len(numbered) >= 2 and re.match(r"\s*1[.)]\s", line):  # "1. great 2. fun" on one line
                items.extend(p for p in _INLINE_NUMBER_RE.split(line) if p.strip())
                continue
            quoted = [next(g for g in m.groups() if g is not None) for m in _QUOTED_RE.finditer(line)]
            rest = _QUOTED_RE.sub("", line)
            if len(quoted) >= 2 and not re.sub(r"[\s,;.:\-*\d\[\]()]|and|or|span", "", rest, flags=re.I):
                items.extend(quoted)
            else:
                items.append(line)
    # A dict keeps the first occurrence's order with O(1) membership (a list's `in` made long answers quadratic).
    return list(dict.fromkeys(span for span in map(clean_span, items) if span))


def label_polarity(label: str) -> int:
    """+1 for a good summarization label, -1 for a bad one, 0 when unknown; a negator before the keyword flips it
    ("not accurate" is bad, "no error" is good)."""
    low = " ".join(label.lower().split())
    for keywords, sign in ((NEGATIVE_LABEL_KEYWORDS, -1), (POSITIVE_LABEL_KEYWORDS, 1)):
        hits = [low.index(k) for k in keywords if k in low]
        if hits:
            return -sign if _NEGATOR_RE.search(low[: min(hits)]) else sign
    return 0


def continuation_header(prompt: str | None) -> str | None:
    """The answer header `prompt` ends with, which the critic's answer continues (RELC's prompt files end so); None
    when it ends otherwise (with the text under critique, or a line such as ``[Continuation]:`` that is no header).

    Example:
        >>> continuation_header("Sentence to be Labeled:\\nIt was fine.\\n\\nIdentified Positive Text Span:\\n")
        'Identified Positive Text Span:'
    """
    if not prompt or not prompt.strip():
        return None
    last = prompt.rstrip().splitlines()[-1].strip()
    if not last.endswith(":") or len(last) > 120:
        return None
    m = _HEADER_RE.search(last)
    # The whole line must be the header: "Review: a wonderful film, a Positive:" is text, not a header.
    return last if m is not None and m.start() == 0 and not last[m.end() :].strip() else None


def _continued(text: str, header: str | None) -> str:
    """`text` with the header it continues put in front, unless the critic repeated that header itself."""
    if not header or " ".join(text.lower().split()).startswith(" ".join(header.lower().split())):
        return text
    # Only an answer with span structure continues the header: a refusal or chatter ("I cannot help with that.")
    # would otherwise become a span of the first section.
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    structured = (
        _MARKED_LINE_RE.match(first)
        or _NONE_RE.match(first)
        or _LABELED_RE.search(first)
        or _HEADER_RE.search(text)
        or _LABELED_RE.search(text)
    )
    return f"{header}\n{text}" if structured else text


def parse_critic_answer(answer: str | None, continues: str | None = None) -> ParsedCritique:
    """Read the positive and negative spans of a critic answer (None gives ``ok=False``) in any supported format;
    `continues` is the header the critic prompt ended with (`continuation_header`), read as the answer's start.
    Spans keep their wording (`locate_span` finds them case- and whitespace-insensitively)."""
    if answer is None:
        return ParsedCritique(ok=False, reason="no answer")
    if not isinstance(answer, str):
        return ParsedCritique(ok=False, reason=f"answer is a {type(answer).__name__}, not text")
    text = answer.replace("\r\n", "\n").replace("\r", "\n")
    if not text.strip():
        return ParsedCritique(ok=False, reason="empty answer")
    text = _ONE_LINE_LABELS_RE.sub("\\1\n", _continued(text, continues))

    result = ParsedCritique()
    # Under "Problematic Spans Identified in the Summary:" every listed span is a flaw; its label only says which.
    all_flaws = _PROBLEM_HEADER_RE.search(text) is not None

    labeled = list(_LABELED_RE.finditer(text))
    for m in labeled:
        span, polarity = clean_span(m.group("span")), label_polarity(m.group("label"))
        if not span:
            continue
        if polarity == 0 and not all_flaws:
            result.unknown_labels.append(m.group("label").strip())
        else:
            (result.positive if polarity > 0 else result.negative).append(span)
    text_wo_labeled = _LABELED_RE.sub("", text)

    headers = list(_HEADER_RE.finditer(text_wo_labeled))
    # Spans already listed per polarity, as sets: "Toxic Span k:" lines are one header each, and a list's `in` over
    # every span so far made an answer of n such lines quadratic.
    seen = {"positive": set(result.positive), "negative": set(result.negative)}
    for k, m in enumerate(headers):
        end = headers[k + 1].start() if k + 1 < len(headers) else len(text_wo_labeled)
        polarity = (m.group("a") or m.group("b") or "negative").lower()
        target = result.positive if polarity == "positive" else result.negative
        for span in _split_items(text_wo_labeled[m.end() : end]):
            if span not in seen[polarity]:
                seen[polarity].add(span)
                target.append(span)
    lead = text_wo_labeled[: headers[0].start()] if headers else ""
    # Spans before the first header belong to a section whose header the prompt held: without `continues` they are
    # lost, which the caller must be able to see.
    if _SPAN_MARKER_RE.search(lead) or any(_MARKED_LINE_RE.match(ln) for ln in lead.splitlines() if ln.strip()):
        result.ignored_text = lead.strip()

    # without spans, "None identified" or "No toxic spans." is a valid, empty answer
    if labeled or headers or _NONE_RE.match(text.strip().splitlines()[0]) or _NONE_ANYWHERE_RE.search(text):
        return result
    return ParsedCritique(ok=False, reason="no span format recognised")
