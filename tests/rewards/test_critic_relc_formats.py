"""RELC compatibility of the critic reward: answers that continue the header each RELC prompt file ends with, spans
across the query/response boundary, fuzzy matching, and RELC's toxicity token rewards.

The fixtures are written here: for every prompt file of RELC (google-research/relc/llm-intrinsic-reward/prompts),
the header it ends with and a short made-up answer in its format; no RELC text is copied."""

import logging

import pytest

from trl_stable.compat.relc_critic import (
    RelcCriticRewardConfig,
    parse_relc_answer,
    relc_continuation_header,
    relc_token_reward_values,
)
from trl_stable.rewards import CriticBackend, CriticIntrinsicReward, CriticRewardConfig, parse_critic_answer
from trl_stable.rewards.critic.alignment import align_span, span_token_rewards
from trl_stable.rewards.critic.parsing import continuation_header

SENT_V2 = "Identified Positive Text Span:"
SENT_V1 = "Identified Text Span:"
TOXIC = "Toxic Spans Identified in the Sentence:"
SUMM = "Problematic Spans Identified in the Summary:"
WORDS = "Rewards assigned:"  # appended by RELC's code (create_question) after the per-word files

# file -> (the header the critic continues, a made-up answer, expected positive spans, expected negative spans)
RELC_SPAN_PROMPTS = {
    "prompt_sentiment_3shot_v2.txt": (
        SENT_V2,
        "\n[Span 1]: a joy to watch\n\nIdentified Negative Text Span:\n[Span 1]: too long",
        ["a joy to watch"],
        ["too long"],
    ),
    "prompt_sentiment_3shot.txt": (SENT_V1, "\n[Span 1]: dull\n[Span 2]: fell flat", [], ["dull", "fell flat"]),
    "prompt_toxicity_3shot_v2.txt": (
        TOXIC,
        "\nToxic Span 1: dumb jerk\nToxic Span 2: shut up.",
        [],
        ["dumb jerk", "shut up"],
    ),
    "prompt_summ_3shot.txt": (
        SUMM,
        "\nSpan 1: sold his car (Label: Factually Incorrect)\n\nIs the summary missing key information?\nYes",
        [],
        ["sold his car"],
    ),
    "prompt_summ_3shot_rlhf.txt": (SUMM, "\nSpan 1: twice twice (Label: Incoherent)", [], ["twice twice"]),
    "prompt_summ_3shot_rouge.txt": (SUMM, "\nSpan 1: on a boat (Label: Irrelevant)", [], ["on a boat"]),
    "prompt_summ_3shot_rouge_rlhf.txt": (SUMM, "\nNone identified", [], []),
    "prompt_summ_3shot_rouge_v2.txt": (
        SUMM,
        "\nSpan 1: in May (Label: Non-factual)\nSpan 2: her dog (Label: Irrelevant)",
        [],
        ["in May", "her dog"],
    ),
}
# Per-word score files: the file ends with an example's scores; RELC's code appends the task and "Rewards assigned:".
RELC_WORD_PROMPTS = {
    "prompt_1shot.txt": ("1. So: 0.2\n2.  bad: -0.8\n3.  film: -0.1", ["So"], ["bad film"]),  # by sign
    "prompt_2shot.txt": ("1. A: 0\n2.  lovely: 1\n3.  day: 0", ["lovely"], []),
    "prompt_3shot.txt": ("1. It: 0\n2.  bored: -1\n3.  me: 0", [], ["bored"]),
    "prompt_3shot_v2.txt": (
        "1. Great: 1\n2.  fun: 1\n3. ,: 0\n4.  but: 0\n5.  sl: -1\n6. ow: -1",
        ["Great fun"],
        ["slow"],
    ),
    "prompt_3shot_v3.txt": ("1. The: 0\n2.  worst: -1", [], ["worst"]),
    "prompt_toxicity_3shot.txt": ("1. You: 0\n2.  idi: -1\n3. ot: -1\n4. .: 0", [], ["idiot"]),
}
# RELC's llama2 files prompt the policy to continue a sentence; no critic answers them.
RELC_POLICY_PROMPTS = {
    "llama2_prompt.txt": "Sentence: {} [/INST]",
    "llama2_prompt_v2.txt": "Sentence: {}",
    "llama2_prompt_3shot.txt": "Sentence: {}",
    "llama2_prompt_0shot_v2.txt": "[Continuation]:",
    "llama2_prompt_1shot_v2.txt": "[Continuation]:",
    "llama2_prompt_2shot_v2.txt": "[Continuation]:",
    "llama2_prompt_3shot_v2.txt": "[Continuation]:",
}


@pytest.mark.parametrize("name", sorted(RELC_SPAN_PROMPTS))
def test_continuation_of_each_relc_span_prompt(name):
    header, answer, positive, negative = RELC_SPAN_PROMPTS[name]
    prompt_tail = f"Sentence to be Labeled:\nsome text\n\n{header}"
    assert continuation_header(prompt_tail) == header
    parsed = parse_critic_answer(answer, continues=header)
    assert parsed.ok and (parsed.positive, parsed.negative) == (positive, negative)
    # The critic repeating the header itself reads the same.
    again = parse_critic_answer(header + answer, continues=header)
    assert (again.positive, again.negative) == (positive, negative)


def test_without_the_continued_header_leading_spans_are_reported_not_silently_lost():
    _, answer, _, _ = RELC_SPAN_PROMPTS["prompt_sentiment_3shot_v2.txt"]
    parsed = parse_critic_answer(answer)  # the caller did not say which header the prompt ended with
    assert parsed.positive == [] and parsed.negative == ["too long"]
    assert parsed.ignored_text == "[Span 1]: a joy to watch"


@pytest.mark.parametrize("name", sorted(RELC_WORD_PROMPTS))
def test_per_word_score_answers(name):
    answer, positive, negative = RELC_WORD_PROMPTS[name]
    prompt = f"=== Task ===\nSentence: x\n\nWords:\n1. x\n\n{WORDS}"
    assert relc_continuation_header(prompt) == WORDS and continuation_header(prompt) is None  # RELC's format only
    parsed = parse_relc_answer(answer, continues=WORDS)
    assert parsed.ok and (parsed.positive, parsed.negative) == (positive, negative)
    # without the header the per-word lines are still read, where the answer has no span structure
    again = parse_relc_answer(answer)
    assert again.ok and (again.positive, again.negative) == (positive, negative)
    assert not parse_critic_answer(answer).ok  # the core parser speaks no per-word format


@pytest.mark.parametrize("name", sorted(RELC_POLICY_PROMPTS))
def test_policy_prompts_have_no_critic_header(name):
    assert continuation_header(f"Instructions.\n\n{RELC_POLICY_PROMPTS[name]}") is None


def test_bundled_prompts_expect_headed_answers():
    from trl_stable.rewards.critic.templates import default_prompt_file, load_critic_template

    for task, first_header in (("sentiment", SENT_V2), ("toxicity", "Toxic Span"), ("summarization", "Span 1:")):
        template = load_critic_template(default_prompt_file(task))
        assert continuation_header(template) is None  # they end with the text, the answer carries its headers
        assert first_header in template and "Start your answer with" in template


def test_span_across_the_query_boundary_rewards_its_response_part():
    # query "It was truly", response " awful film." -> tokens " awful", " film", "."
    text, offsets = " awful film.", [(0, 6), (6, 11), (11, 12)]
    a = align_span(text, "truly awful film", context="It was truly")
    assert (a.status, a.ranges) == ("partial", [(0, 11)])
    assert span_token_rewards(text, offsets, [], ["truly awful film"], context="It was truly") == [-0.5, -0.5, 0.0]
    # without the query the span is not in the response at all
    assert span_token_rewards(text, offsets, [], ["truly awful film"]) == [0.0, 0.0, 0.0]
    # a span only in the query rewards nothing
    assert align_span(text, "It was", context="It was truly").status == "query_only"


def test_trailing_punctuation_and_inner_commas_match_without_fuzzy():
    text, offsets = " I will kill you, idiot!", [(0, 2), (2, 7), (7, 12), (12, 16), (16, 17), (17, 23), (23, 24)]
    assert span_token_rewards(text, offsets, [], ["kill you idiot."]) == [0, 0, -0.5, -0.5, -0.5, -0.5, 0]
    assert span_token_rewards(text, offsets, [], ["idiot!!"]) == [0, 0, 0, 0, 0, -0.5, 0]


def test_fuzzy_matching_off_and_on():
    text = " the plot was dull and slow"
    offsets = [(0, 4), (4, 9), (9, 13), (13, 18), (18, 22), (22, 27)]
    span = "plot is dull"  # the critic reworded "was"
    assert align_span(text, span).status == "unmatched"
    assert span_token_rewards(text, offsets, [], [span]) == [0.0] * 6
    pytest.importorskip("rapidfuzz")
    a = align_span(text, span, fuzzy_min_similarity=0.8)
    assert a.fuzzy and a.status == "matched" and text[slice(*a.ranges[0])] == "plot was dull"
    # partial_ratio: the best 12-character window of the text against the 12-character span, 2 * 10 / (12 + 12)
    assert a.similarity == pytest.approx(20 / 24)
    assert span_token_rewards(text, offsets, [], [span], fuzzy_min_similarity=0.8) == [0, -0.5, -0.5, -0.5, 0, 0]
    # below the floor: not matched
    assert not align_span(text, span, fuzzy_min_similarity=0.95).ranges
    assert not align_span(text, "is", fuzzy_min_similarity=0.5).ranges  # too short to match fuzzily


def test_relc_toxicity_token_rewards_by_hand():
    # RELC's toxicity script: r = negative_reward_value inside a toxic span, positive_reward_value elsewhere.
    # Response tokens (after the query "Hey,"): "total", " idiot", ",", " shut", " up", " now"; toxic spans
    # "total idiot" and "shut up"; RELC's --positive_reward_value 0.1 --negative_reward_value -0.5 gives
    # [-0.5, -0.5, 0.1, -0.5, -0.5, 0.1] (each of these tokens is or is not a substring of its joined spans).
    assert relc_token_reward_values("toxicity", 0.1, -0.5) == (0.0, -0.5, 0.1)
    cfg = RelcCriticRewardConfig.from_relc(task="toxicity", positive_reward_value=0.1, negative_reward_value=-0.5)
    text, offsets = "total idiot, shut up now", [(0, 5), (5, 11), (11, 12), (12, 17), (17, 20), (20, 24)]
    spans = parse_critic_answer("\nToxic Span 1: total idiot\nToxic Span 2: shut up", continues=TOXIC)
    row = span_token_rewards(
        text,
        offsets,
        spans.positive,
        spans.negative,
        cfg.positive_reward_value,
        cfg.negative_reward_value,
        cfg.outside_span_reward_value,
        context="Hey,",
    )
    assert row == [-0.5, -0.5, 0.1, -0.5, -0.5, 0.1]
    # "None identified": every token is non-toxic, as in RELC
    none = parse_critic_answer("\nNone identified", continues=TOXIC)
    assert span_token_rewards(text, offsets, none.positive, none.negative, 0.0, -0.5, 0.1) == [0.1] * 6


def test_relc_mapping_per_task_and_warning(caplog):
    assert relc_token_reward_values("sentiment", 0.5, -0.5) == (0.5, -0.5, 0.0)
    assert relc_token_reward_values("summarization", 1.0, -1.0) == (0.0, -1.0, 1.0)
    cfg = RelcCriticRewardConfig.from_relc(
        "summarization", 1.0, -1.0, intrinsic_reward_threshold=100.0, critic_backend="openai"
    )
    assert (cfg.critic_task, cfg.outside_span_reward_value, cfg.intrinsic_reward_threshold) == (
        "summarization",
        1.0,
        100,
    )
    with pytest.raises(ValueError, match="task"):
        relc_token_reward_values("qa", 1.0, -1.0)
    with caplog.at_level(logging.WARNING, logger="trl_stable.rewards.critic"):
        CriticRewardConfig(critic_task="toxicity", positive_reward_value=0.1)
    assert "outside_span_reward_value" in caplog.text


def test_fuzzy_config_validation():
    with pytest.raises(ValueError, match="fuzzy_min_similarity"):
        CriticRewardConfig(fuzzy_min_similarity=0.0)
    assert CriticRewardConfig().fuzzy_threshold is None
    assert CriticRewardConfig(fuzzy_span_matching=True, fuzzy_min_similarity=0.7).fuzzy_threshold == 0.7


class Scripted(CriticBackend):
    name = "scripted"

    def __init__(self, answers):
        super().__init__()
        self.answers = list(answers)

    def generate(self, prompts, texts=None):
        self.counters.add("requests", len(prompts))
        return [self.answers.pop(0) for _ in prompts]


def test_end_to_end_relc_prompt_continuation_and_step_metrics(tokenizer, tmp_path, caplog):
    prompt_file = tmp_path / "relc_like.txt"
    prompt_file.write_text(f"Label the sentence.\n\nSentence to be Labeled:\n{{}}\n\n{SENT_V2}")
    cfg = CriticRewardConfig(use_intrinsic_reward=True, critic_backend="openai", prompt_file=str(prompt_file))
    answers = [
        "\n[Span 1]: truly wonderful\n\nIdentified Negative Text Span:\nNone identified",
        "I cannot help with that.",
    ]
    fn = CriticIntrinsicReward(cfg, tokenizer, backend=Scripted(answers))
    assert fn.answer_header == SENT_V2
    completions = [" wonderful cast", " ok"]
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    logged = {}
    with caplog.at_level(logging.WARNING, logger="trl_stable.rewards.critic"):
        rows = fn(["It was truly", "Meh"], completions, ids, log_metric=logged.__setitem__)
    decoded = [tokenizer.decode([t]) for t in ids[0]]
    assert [d for d, v in zip(decoded, rows[0]) if v == 0.5] == [" wonderful"]  # the response part of the span
    assert rows[1] is None  # unparseable: no reward, but counted and logged
    assert logged["critic/unparseable_fraction"] == 0.5
    assert logged["critic/spans_partial_frac"] == 1.0 and logged["critic/spans_matched_frac"] == 0.0
    assert "no recognisable span format" in caplog.text
    m = fn.metrics()
    assert m["critic/unparseable"] == 1 and m["critic/spans_partial"] == 1 and m["critic/spans_unlocated"] == 0


def test_relc_config_reads_per_word_answers_end_to_end(tokenizer, tmp_path):
    prompt_file = tmp_path / "relc_words.txt"
    prompt_file.write_text(f"Score each word of the sentence.\nSentence: {{}}\n\n{WORDS}")
    answer = "1. It: 0\n2.  was: 0\n3.  dull: -1"
    completion = " It was dull"
    ids = [tokenizer(completion, add_special_tokens=False)["input_ids"]]
    relc = RelcCriticRewardConfig(use_instric_reward=True, prompt_file=str(prompt_file))
    fn = CriticIntrinsicReward(relc, tokenizer, backend=Scripted([answer]))
    assert fn.answer_header == WORDS
    (row,) = fn([""], [completion], ids)
    assert [tokenizer.decode([t]) for t, v in zip(ids[0], row) if v == -0.5] == [" dull"]
    # our own config reads our formats only: the template's last line is no header it knows, the answer no span
    plain = CriticIntrinsicReward(
        CriticRewardConfig(use_intrinsic_reward=True, prompt_file=str(prompt_file)),
        tokenizer,
        backend=Scripted([answer]),
    )
    assert plain.answer_header is None and plain([""], [completion], ids) == [None]
