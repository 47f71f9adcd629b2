"""`LexiconCritic`: an offline critic answering in the LLM answer format from a lexicon: VADER (Hutto & Gilbert,
ICWSM 2014) or AFINN-165 (Nielsen, ESWC 2011 workshop "Making Sense of Microposts") for sentiment, alt-profanity-check
for toxicity."""

from __future__ import annotations

import re
from collections.abc import Sequence

from trl_stable.rewards.critic.alignment import merge_ranges
from trl_stable.rewards.critic.backend import CriticBackend

_WORD_RE = re.compile(r"[A-Za-z][A-Za-z'\u2019]*[A-Za-z]|[A-Za-z]")


def format_sentiment_answer(positive: Sequence[str], negative: Sequence[str]) -> str:
    def block(spans: Sequence[str]) -> str:
        return "\n".join(f"[Span {i}]: {s}" for i, s in enumerate(spans, 1)) or "None identified"

    return f"Identified Positive Text Span:\n{block(positive)}\nIdentified Negative Text Span:\n{block(negative)}"


def format_toxicity_answer(toxic: Sequence[str]) -> str:
    return "\n".join(f"Toxic Span {i}: {s}" for i, s in enumerate(toxic, 1)) or "Toxic Span: None identified"


def _merge(text: str, ranges: list[tuple[int, int]]) -> list[str]:
    """The distinct phrases of `text` that ranges overlapping or touching through whitespace make up."""
    return list(dict.fromkeys(" ".join(text[a:b].split()) for a, b in merge_ranges(ranges, text)))


SENTIMENT_LEXICONS = ("vader", "afinn")
# Negators of the AFINN critic: its own short list, so that it shares no word list with VADER (the embedded
# environment reward); "n't" endings are caught separately.
_AFINN_NEGATE = frozenset(
    "not no never none nobody nothing neither nor nowhere without cannot hardly barely scarcely".split()
)


def afinn_lexicon() -> dict[str, float]:
    """The single-word entries of AFINN-165 (valences -5..5) from the `afinn` package; spans are found word by word."""
    from importlib import resources

    try:
        data = resources.files("afinn") / "data" / "AFINN-en-165.txt"
    except ModuleNotFoundError as err:
        raise ImportError(
            "The AFINN lexicon critic needs the afinn package: pip install afinn (or trl_stable[rewards])."
        ) from err
    entries = (line.rpartition("\t") for line in data.read_text(encoding="utf-8").splitlines())
    return {word.lower(): float(value) for word, _, value in entries if word and " " not in word}


class LexiconCritic(CriticBackend):
    """Offline critic answering in the LLM answer format from a lexicon; it annotates the raw ``texts`` (else the
    prompts). Sentiment: a word with ``|valence| >= min_valence`` is a span, flipped and joined by a negator among the
    three words before it ("not good"), joined by a booster ("very"); ``lexicon="afinn"`` has its own negators and no
    boosters, sharing no list with VADER. Toxicity: a word alt-profanity-check scores ``>= toxicity_threshold``.
    Neighbouring spans of one polarity merge."""

    name = "lexicon"

    def __init__(
        self,
        task: str = "sentiment",
        min_valence: float = 1.0,
        toxicity_threshold: float = 0.5,
        lexicon: str = "vader",
    ) -> None:
        super().__init__()
        if task not in ("sentiment", "toxicity"):
            raise ValueError(f"LexiconCritic task must be 'sentiment' or 'toxicity', got {task!r}.")
        if lexicon not in SENTIMENT_LEXICONS:
            raise ValueError(f"LexiconCritic lexicon must be one of {SENTIMENT_LEXICONS}, got {lexicon!r}.")
        self.task = task
        self.lexicon = lexicon
        self.min_valence = min_valence
        self.toxicity_threshold = toxicity_threshold
        if task == "sentiment" and lexicon == "afinn":
            self._lexicon = afinn_lexicon()
            self._negate = set(_AFINN_NEGATE)
            self._boost: set[str] = set()
        elif task == "sentiment":
            from vaderSentiment import vaderSentiment as vader

            self._lexicon = vader.SentimentIntensityAnalyzer().lexicon
            self._negate = {w.lower() for w in vader.NEGATE}
            self._boost = {w.lower() for w in vader.BOOSTER_DICT}
        else:
            from profanity_check import predict_prob

            self._predict_prob = predict_prob

    def __repr__(self) -> str:
        lexicon = f", lexicon={self.lexicon!r}" if self.task == "sentiment" else ""
        return f"LexiconCritic(task={self.task!r}{lexicon})"

    def scored_spans(self, text: str) -> list[tuple[int, int, float]]:
        """(start, end, valence) of each sentiment word of `text`, its range including a negator and a booster."""
        if self.task != "sentiment":
            raise ValueError("scored_spans needs a sentiment LexiconCritic.")
        words = [(m.group(0), m.start(), m.end()) for m in _WORD_RE.finditer(text)]
        spans: list[tuple[int, int, float]] = []
        for i, (word, start, end) in enumerate(words):
            valence = self._lexicon.get(word.lower().replace("\u2019", "'"))
            if valence is None or abs(valence) < self.min_valence:
                continue
            lo = words[i - 1][1] if i > 0 and words[i - 1][0].lower() in self._boost else start
            for j in range(i - 1, max(-1, i - 4), -1):
                # A negator reaches over at most two words of its own clause and no other sentiment word.
                if re.search(r"[,.;:!?]", text[words[j][2] : start]):
                    break
                w = words[j][0].lower().replace("\u2019", "'")
                if w in self._negate or w.endswith("n't"):
                    valence, lo = -valence, min(lo, words[j][1])
                    break
                if abs(self._lexicon.get(w, 0.0)) >= self.min_valence:
                    break
            spans.append((lo, end, float(valence)))
        return spans

    def _sentiment(self, text: str) -> str:
        spans = self.scored_spans(text)
        pos = [(lo, end) for lo, end, valence in spans if valence > 0]
        neg = [(lo, end) for lo, end, valence in spans if valence < 0]
        return format_sentiment_answer(_merge(text, pos), _merge(text, neg))

    def _toxicity(self, texts: Sequence[str]) -> list[str]:
        per_text = [list(_WORD_RE.finditer(t)) for t in texts]
        flat = [m.group(0) for words in per_text for m in words]
        probs = iter(self._predict_prob(flat) if flat else ())
        return [
            format_toxicity_answer(_merge(text, [m.span() for m in words if next(probs) >= self.toxicity_threshold]))
            for text, words in zip(texts, per_text)
        ]

    def generate(self, prompts: Sequence[str], texts: Sequence[str] | None = None) -> list[str | None]:
        texts = list(texts) if texts is not None else list(prompts)
        self.counters.add("requests", len(texts))
        self.counters.add("attempts")
        answers = [self._sentiment(t) for t in texts] if self.task == "sentiment" else self._toxicity(texts)
        self.counters.add("successes", len(texts))
        return list(answers)
