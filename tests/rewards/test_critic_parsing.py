"""Critic answer parsing: every format of docs/critic_rewards.md#prompts, plus the ways LLMs deviate from it."""

import pytest

from trl_stable.rewards import parse_critic_answer
from trl_stable.rewards.critic.lexicon import format_sentiment_answer, format_toxicity_answer
from trl_stable.rewards.critic.parsing import clean_span, label_polarity


@pytest.mark.parametrize(
    "answer, positive, negative",
    [
        (
            "Identified Positive Text Span:\n[Span 1]: a wonderful film\n[Span 2]: superb acting\n"
            "Identified Negative Text Span:\nNone identified",
            ["a wonderful film", "superb acting"],
            [],
        ),
        # everything on one line (RELC flattened newlines)
        (
            "Identified Positive Text Span: [Span 1]: great [Span 2]: fun. Identified Negative Text Span: "
            "[Span 1]: boring",
            ["great", "fun"],
            ["boring"],
        ),
        # prose before and after, numbered and quoted items, "None identified." with a period
        (
            "Sure! Here is my analysis.\nIdentified Positive Text Span: None identified.\n"
            "Identified Negative Text Span:\n1. \"dull\"\n2) 'a waste of time'\nExplanation: dull is negative.",
            [],
            ["dull", "a waste of time"],
        ),
        # bare span after the header, curly quotes, trailing punctuation outside the quotes
        ("Identified Positive Text Span: \u201cgreat fun\u201d.\nIdentified Negative Text Span: meh!",
         ["great fun"], ["meh"]),
        # several quoted spans on one line, short headers, bullet markers
        ('Positive spans: "fun", "lovely"\nNegative spans:\n- awful\n* "not good"',
         ["fun", "lovely"], ["awful", "not good"]),
        ("Toxic Span 1: idiot\nToxic Span 2: shut up!", [], ["idiot", "shut up"]),
        ("Toxic Span: None identified", [], []),
        ("Toxic Spans:\n- idiot\n- you moron", [], ["idiot", "you moron"]),
        ("toxic span [1]: 'dumb'", [], ["dumb"]),
        ("None identified", [], []),
        ("Identified Positive Text Span: it's good\nIdentified Negative Text Span: No negative spans identified.",
         ["it's good"], []),
        # markdown emphasis around headers and bullets
        ('**Identified Positive Text Span:**\n- [Span 1]: "great"\n**Identified Negative Text Span:** None identified',
         ["great"], []),
        # inline numbering on one line; numbers inside a span survive
        ("Identified Positive Text Spans: 1. great 2. fun 3. a 10 out of 10 film",
         ["great", "fun", "a 10 out of 10 film"], []),
        # bare "Positive:"/"Negative:" headers
        ("Positive: great\nNegative: boring", ["great"], ["boring"]),
        # commentary after a quoted span
        ("Toxic Span 1: \"idiot\" (insult)\nToxic Span 2: 'it's garbage' - demeaning", [], ["idiot", "it's garbage"]),
        # a punctuation-only span keeps its characters
        ("Identified Positive Text Span:\n[Span 1]: \"wow!\"", ["wow!"], []),
    ],
)  # fmt: skip
def test_sentiment_and_toxicity_formats(answer, positive, negative):
    parsed = parse_critic_answer(answer)
    assert parsed.ok, parsed.reason
    assert parsed.positive == positive
    assert parsed.negative == negative


def test_summarization_labels():
    answer = (
        "Here are the spans:\nSpan 1: the senator resigned (Label: key point)\n"
        "Span 2: on Tuesday (Label: inaccurate)\n"
        'Span 3: said that (Label: whatever)\n[Span 4]: "he quit quit" (Label: redundant).'
    )
    parsed = parse_critic_answer(answer)
    assert parsed.ok
    assert parsed.positive == ["the senator resigned"]
    assert parsed.negative == ["on Tuesday", "he quit quit"]
    assert parsed.unknown_labels == ["whatever"]


@pytest.mark.parametrize(
    "label, polarity",
    [("good", 1), ("Key point", 1), ("accurate", 1), ("inaccurate", -1), ("irrelevant", -1), ("incorrect", -1),
     ("unfaithful", -1), ("hallucination", -1), ("bad", -1), ("neutral", 0)],
)  # fmt: skip
def test_label_polarity_negations_first(label, polarity):
    assert label_polarity(label) == polarity


@pytest.mark.parametrize("answer", [None, "", "   \n", "asdkjh qwe 123", 42, "I cannot help with that request."])
def test_unparseable_answers_yield_no_spans(answer):
    parsed = parse_critic_answer(answer)
    assert not parsed.ok
    assert parsed.reason
    assert parsed.positive == [] and parsed.negative == []


def test_clean_span():
    assert clean_span('  1. "Great acting,"  ') == "Great acting"
    assert clean_span("[Span 3]: \u2018superb\u2019;") == "superb"
    assert clean_span("- None identified.") == ""
    assert clean_span("N/A") == ""
    assert clean_span("not bad") == "not bad"


def test_formatters_round_trip():
    pos, neg = ["great", "very funny"], ["not good"]
    parsed = parse_critic_answer(format_sentiment_answer(pos, neg))
    assert (parsed.positive, parsed.negative) == (pos, neg)
    parsed = parse_critic_answer(format_sentiment_answer([], []))
    assert parsed.ok and parsed.positive == [] and parsed.negative == []
    parsed = parse_critic_answer(format_toxicity_answer(["idiot", "shut up"]))
    assert parsed.negative == ["idiot", "shut up"] and parsed.positive == []
    assert parse_critic_answer(format_toxicity_answer([])).ok


@pytest.mark.parametrize(
    "answer, positive, negative",
    [
        # "toxic spans" inside a none-sentence is not a header ("identified" was read as a toxic span)
        ("No toxic spans identified.", [], []),
        ("There are no toxic spans in this text.", [], []),
        ("The text is fine. None identified.", [], []),
        # commentary after the spans is not a span
        ("Toxic Span 1: idiot\n\nOverall, the text is mildly toxic.", [], ["idiot"]),
        ("Positive: great\nThe rest is neutral.", ["great"], []),
        ("Identified Positive Text Span:\n[Span 1]: great\n\nNote that the text is short.", ["great"], []),
        ("Identified Positive Text Span: great\nIdentified Negative Text Span: None identified\nIt is positive.",
         ["great"], []),
        # ...while bare spans listed under an empty header line are all kept
        ("Identified Positive Text Span:\ngreat acting\nfun plot\nIdentified Negative Text Span:\nNone identified",
         ["great acting", "fun plot"], []),
        ("Identified Positive Text Span: 1. great\n2. fun", ["great", "fun"], []),
        # a parenthesised note after a span
        ("Toxic Span 1: idiot (insult)\nToxic Span 2: (expletive)", [], ["idiot", "(expletive)"]),
        # numbered labelled lines, negated labels
        ("1. Span 1: the cat (Label: Good)\n2) the mat (Label: not accurate)", ["the cat"], ["the mat"]),
        ("- [Span 1]: he left (Label: no error)", ["he left"], []),
        # labelled spans run together on one line
        ("Span 1: a cat (Label: good) Span 2: the mat (Label: bad). [Span 3]: sat (Label: good)",
         ["a cat", "sat"], ["the mat"]),
    ],
)  # fmt: skip
def test_prose_none_sentences_and_numbering(answer, positive, negative):
    parsed = parse_critic_answer(answer)
    assert parsed.ok, parsed.reason
    assert (parsed.positive, parsed.negative) == (positive, negative)


@pytest.mark.parametrize(
    "label, polarity",
    [("not accurate", -1), ("Not relevant", -1), ("non-essential", -1), ("no error", 1), ("unimportant", -1)],
)
def test_label_polarity_negators(label, polarity):
    assert label_polarity(label) == polarity


def test_parser_is_linear_in_the_number_of_span_lines(monkeypatch):
    """Count span comparisons instead of timing: deduplicating by list membership compared each new span with every
    earlier one (n**2 / 2 comparisons, 1.8 s for 10,000 lines); a set compares only on equal hashes."""
    from trl_stable.rewards.critic import parsing as critic_parsing

    comparisons = [0]

    class CountingSpan(str):
        __hash__ = str.__hash__

        def __eq__(self, other):
            comparisons[0] += 1
            return str.__eq__(self, other)

    real_clean = critic_parsing.clean_span
    monkeypatch.setattr(critic_parsing, "clean_span", lambda raw: CountingSpan(real_clean(raw)))
    n = 3000
    formats = {
        "sentiment": "Identified Positive Text Span:\n" + "\n".join(f"[Span {i}]: word{i}" for i in range(n)),
        "toxicity": "\n".join(f"Toxic Span {i}: word{i}" for i in range(n)),  # one header per line
    }
    for name, answer in formats.items():
        comparisons[0] = 0
        parsed = critic_parsing.parse_critic_answer(answer)
        spans = parsed.positive if name == "sentiment" else parsed.negative
        assert spans == [f"word{i}" for i in range(n)], name  # every span, in order, once
        assert comparisons[0] <= 2 * n, (name, comparisons[0])  # quadratic: ~n**2 / 2 = 4.5 million


def test_parser_keeps_first_occurrence_order_and_drops_duplicates():
    parsed = parse_critic_answer("Toxic Span 1: idiot\nToxic Span 2: moron\nToxic Span 3: idiot")
    assert parsed.negative == ["idiot", "moron"]
    from trl_stable.compat.relc_critic import parse_relc_answer

    words = parse_relc_answer("1. a: -1\n2. b: 1\n3. a: -1\n4. c: 0", continues="Rewards assigned:")
    assert words.negative == ["a"] and words.positive == ["b"]
