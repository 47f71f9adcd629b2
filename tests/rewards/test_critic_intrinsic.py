"""The dense intrinsic reward function: selection by threshold, alignment to completion tokens, every backend,
failure handling, metrics, config."""

import dataclasses
import logging
import math

import pytest
import torch

from trl_stable.rewards import (
    CriticBackend,
    CriticFailureError,
    CriticIntrinsicReward,
    CriticRewardConfig,
    LexiconCritic,
    TransformersCritic,
    is_dense_reward,
    parse_critic_answer,
    validate_dense_rewards,
)
from trl_stable.rewards.critic.templates import default_prompt_file, fill_critic_template, load_critic_template
from trl_stable.testing import build_causal_lm

try:
    from fake_openai_server import FakeOpenAIServer, drop, hang, malformed, reply, status
except ImportError:
    from tests.rewards.fake_openai_server import FakeOpenAIServer, drop, hang, malformed, reply, status

DUMMY_KEY = "sk-test-DUMMY-intrinsic-9c1d"


def encode(tokenizer, texts, eos=True):
    return [
        tokenizer(t, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else []) for t in texts
    ]


def rewarded_text(tokenizer, ids, row, sign):
    """The characters of the tokens whose reward has `sign` (+1/-1), whitespace removed."""
    return "".join(tokenizer.decode([t]) for t, v in zip(ids, row) if v * sign > 0).replace(" ", "")


class ScriptedCritic(CriticBackend):
    """Answers from a function of the prompt (None = failed request); records what it was asked."""

    name = "scripted"

    def __init__(self, answer):
        super().__init__()
        self.answer = answer
        self.prompts = []

    def generate(self, prompts, texts=None):
        self.prompts.extend(prompts)
        self.counters.add("requests", len(prompts))
        return [self.answer(p) for p in prompts]


def test_is_dense_and_lexicon_sentiment_end_to_end(tokenizer):
    cfg = CriticRewardConfig(use_intrinsic_reward=True, intrinsic_reward_threshold=0.5)
    fn = CriticIntrinsicReward(cfg, tokenizer)
    assert is_dense_reward(fn) and fn.__name__ == "critic_sentiment"
    completions = [" The plot was great but the ending was boring.", " It rained.", " What a wonderful day"]
    ids = encode(tokenizer, completions)
    rows = fn(["Review: the great"] * 3, completions, ids, env_rewards=[0.1, 0.5, 0.9])
    assert validate_dense_rewards(rows, [len(i) for i in ids])
    assert rows[2] is None  # env reward 0.9 > threshold: not critiqued
    assert rows[1] == [0.0] * len(ids[1])  # critiqued, nothing found
    assert rewarded_text(tokenizer, ids[0], rows[0], +1) == "great"
    assert rewarded_text(tokenizer, ids[0], rows[0], -1) == "boring"
    assert set(rows[0]) <= {0.0, 0.5, -0.5} and rows[0][-1] == 0.0  # EOS gets nothing
    m = fn.metrics()
    assert m["critic/critiqued"] == 2 and m["critic/samples"] == 3 and m["critic/requests"] == 2
    assert m["critic/spans_positive"] == 1 and m["critic/spans_negative"] == 1
    n_rewarded = sum(v != 0 for v in rows[0])
    assert m["critic/tokens_rewarded"] == n_rewarded
    assert m["critic/rewarded_token_fraction"] == pytest.approx(n_rewarded / sum(len(i) for i in ids))
    assert m["critic/last_critiqued_fraction"] == pytest.approx(2 / 3)
    assert all(k.startswith("critic/") for k in m)


def test_lexicon_toxicity_with_relc_values(tokenizer):
    cfg = CriticRewardConfig(
        use_intrinsic_reward=True, critic_task="toxicity", positive_reward_value=0.0, negative_reward_value=-0.5,
        intrinsic_reward_threshold=1.0,
    )  # fmt: skip
    fn = CriticIntrinsicReward(cfg, tokenizer)
    completions = [" you are a stupid idiot and I like tea", " I like tea"]
    ids = encode(tokenizer, completions)
    rows = fn(["x", "x"], completions, ids, env_rewards=[0.9, 0.2])
    assert rewarded_text(tokenizer, ids[0], rows[0], -1) == "stupididiot"
    assert max(rows[0]) == 0.0 and rows[1] == [0.0] * len(ids[1])


def test_threshold_selection_and_nan_env_reward(tokenizer):
    critic = ScriptedCritic(lambda p: "Identified Positive Text Span: None identified")
    cfg = CriticRewardConfig(use_intrinsic_reward=True, intrinsic_reward_threshold=1.0)
    fn = CriticIntrinsicReward(cfg, tokenizer, backend=critic)
    ids = encode(tokenizer, [" a", " b", " c", " d"])
    rows = fn(["p"] * 4, None, ids, env_rewards=[1.0, 1.5, float("nan"), -3.0])
    assert [r is not None for r in rows] == [True, False, False, True]  # <= threshold; NaN is never critiqued
    assert len(critic.prompts) == 2
    assert fn.metrics()["critic/nan_env_rewards"] == 1
    rows = fn(["p"] * 4, None, ids, env_rewards=torch.tensor([0.5, float("nan"), 2.0, 1.0]))  # a tensor works too
    assert [r is not None for r in rows] == [True, False, False, True]
    assert fn.metrics()["critic/nan_env_rewards"] == 2
    rows = fn(["p"] * 4, None, ids, env_rewards=None)  # no environment reward: critique everything
    assert all(r is not None for r in rows)


def test_disabled_returns_none_and_alias(tokenizer):
    fn = CriticIntrinsicReward(CriticRewardConfig(), tokenizer)
    assert fn(["p"], [" great"], encode(tokenizer, [" great"]), env_rewards=[0.0]) == [None]
    from trl_stable.compat.relc_critic import RelcCriticRewardConfig  # RELC's spelling lives in the compat layer

    assert RelcCriticRewardConfig(use_instric_reward=True).use_intrinsic_reward is True
    assert RelcCriticRewardConfig(use_intrinsic_reward=True, use_instric_reward=False).use_intrinsic_reward is True
    assert RelcCriticRewardConfig(use_instric_reward=False).use_intrinsic_reward is False
    with pytest.raises(TypeError, match="use_instric_reward"):
        CriticRewardConfig(use_instric_reward=True)


def test_critic_prompt_uses_template_prompt_and_true_scale_score(tokenizer):
    critic = ScriptedCritic(lambda p: "Span 1: cat sat (Label: good)\nSpan 2: the mat (Label: wrong)")
    cfg = CriticRewardConfig(
        use_intrinsic_reward=True, critic_task="summarization", critic_backend="openai", critic_base_url="http://x",
        intrinsic_reward_threshold=100.0, positive_reward_value=1.0, negative_reward_value=-1.0,
    )  # fmt: skip
    fn = CriticIntrinsicReward(cfg, tokenizer, backend=critic)
    completion = " the cat sat\non the mat"
    ids = encode(tokenizer, [completion])
    rows = fn(["Post: a cat on a mat. TL;DR:"], [completion], ids, env_rewards=[0.3712])
    prompt = critic.prompts[0]
    assert "Post: Post: a cat on a mat. TL;DR: the cat sat on the mat\nScore: 0.3712" in prompt
    assert "{}" not in prompt and "{score}" not in prompt
    assert rewarded_text(tokenizer, ids[0], rows[0], +1) == "catsat"
    assert rewarded_text(tokenizer, ids[0], rows[0], -1) == "themat"


def test_words_in_prompt_are_not_rewarded(tokenizer):
    critic = ScriptedCritic(lambda p: "Identified Positive Text Span:\n[Span 1]: brilliant\n[Span 2]: loved")
    fn = CriticIntrinsicReward(CriticRewardConfig(use_intrinsic_reward=True), tokenizer, backend=critic)
    completion = " and I loved it"
    ids = encode(tokenizer, [completion])
    rows = fn(["A brilliant film,"], [completion], ids, env_rewards=[0.0])
    assert rewarded_text(tokenizer, ids[0], rows[0], +1) == "loved"
    assert fn.metrics()["critic/spans_unlocated"] == 1  # "brilliant" is only in the prompt


def test_failures_zero_reward_and_consecutive_failing_steps_raise(tokenizer):
    answers = {"mode": "fail"}
    critic = ScriptedCritic(lambda p: None if answers["mode"] == "fail" else "Toxic Span 1: idiot")
    cfg = CriticRewardConfig(use_intrinsic_reward=True, critic_task="toxicity", max_consecutive_failing_steps=3)
    fn = CriticIntrinsicReward(cfg, tokenizer, backend=critic)
    ids = encode(tokenizer, [" you idiot", " fine"])
    call = lambda: fn(["p", "p"], None, ids, env_rewards=[0.0, 0.0])  # noqa: E731
    assert call() == [None, None] and call() == [None, None]
    assert fn.metrics()["critic/consecutive_failing_steps"] == 2
    answers["mode"] = "ok"
    rows = call()  # a working step resets the count
    assert rewarded_text(tokenizer, ids[0], rows[0], -1) == "idiot"
    assert fn.consecutive_failing_steps == 0
    answers["mode"] = "fail"
    call(), call()
    with pytest.raises(CriticFailureError, match="3 consecutive steps"):
        call()
    assert fn.metrics()["critic/failed_answers"] == 10  # the step that raised is recorded too


def test_step_without_critiques_neither_resets_nor_counts_failing_steps(tokenizer):
    critic = ScriptedCritic(lambda p: None)
    cfg = CriticRewardConfig(
        use_intrinsic_reward=True, intrinsic_reward_threshold=0.0, max_consecutive_failing_steps=2
    )
    fn = CriticIntrinsicReward(cfg, tokenizer, backend=critic)
    ids = encode(tokenizer, [" a"])
    fn(["p"], None, ids, env_rewards=[0.0])  # critiqued, failed: 1
    fn(["p"], None, ids, env_rewards=[5.0])  # above the threshold: the critic was not asked
    assert fn.consecutive_failing_steps == 1
    with pytest.raises(CriticFailureError):
        fn(["p"], None, ids, env_rewards=[0.0])


def test_partial_failures_do_not_count_as_failing_steps(tokenizer):
    replies = iter([None, "Identified Positive Text Span: None identified", "lorem ipsum", "None identified"] * 3)
    critic = ScriptedCritic(lambda p: next(replies))
    cfg = CriticRewardConfig(use_intrinsic_reward=True, max_consecutive_failing_steps=1)
    fn = CriticIntrinsicReward(cfg, tokenizer, backend=critic)
    ids = encode(tokenizer, [" a", " b"])
    for _ in range(3):  # each step has one usable critique: never a failing step
        rows = fn(["p", "p"], None, ids, env_rewards=[0.0, 0.0])
        assert sum(r is None for r in rows) == 1
    m = fn.metrics()
    assert m["critic/unparseable"] == 1 and m["critic/failed_answers"] == 2 and m["critic/answers"] == 4
    assert fn.consecutive_failing_steps == 0


def test_garbage_only_critic_counts_as_failing_and_stops(tokenizer):
    critic = ScriptedCritic(lambda p: "lorem ipsum dolor sit amet")
    cfg = CriticRewardConfig(use_intrinsic_reward=True, max_consecutive_failing_steps=2)
    fn = CriticIntrinsicReward(cfg, tokenizer, backend=critic)
    ids = encode(tokenizer, [" a", " b"])
    logged = {}
    assert fn(["p", "p"], None, ids, env_rewards=[0.0, 0.0], log_metric=logged.__setitem__) == [None, None]
    # the garbage is visible in the per-step logs, not only in a warning
    assert logged["critic/failed_fraction"] == 1.0 and logged["critic/unparseable_fraction"] == 1.0
    assert logged["critic/request_failed_fraction"] == 0.0
    assert logged["critic/step_unparseable"] == 2 and logged["critic/step_answers"] == 2
    assert fn.consecutive_failing_steps == 1
    with pytest.raises(CriticFailureError, match="2 unparseable answers") as err:
        fn(["p", "p"], None, ids, env_rewards=[0.0, 0.0])
    assert "span format" in str(err.value)
    assert fn.metrics()["critic/unparseable"] == 4


def test_log_metric_callback(tokenizer):
    logged = {}
    fn = CriticIntrinsicReward(CriticRewardConfig(use_intrinsic_reward=True), tokenizer)
    fn(["p"], None, encode(tokenizer, [" good"]), env_rewards=[0.0], log_metric=logged.__setitem__)
    assert logged["critic/critiqued_fraction"] == 1.0 and logged["critic/rewarded_token_fraction"] == 0.5


def test_openai_backend_end_to_end_against_loopback(tokenizer, monkeypatch, caplog):
    monkeypatch.setenv("OPENAI_API_KEY", DUMMY_KEY)
    with FakeOpenAIServer(answer=lambda p: "Identified Positive Text Span:\n[Span 1]: great") as server:
        cfg = CriticRewardConfig(
            use_intrinsic_reward=True, critic_backend="openai", critic_base_url=server.base_url,
            critic_model="tiny-critic", critic_timeout=2.0, critic_max_retries=1, intrinsic_reward_threshold=0.0,
        )  # fmt: skip
        fn = CriticIntrinsicReward(cfg, tokenizer)
        fn.backend.backoff_base = 0.01
        completions = [" a great day", " great", " meh"]
        ids = encode(tokenizer, completions)
        # One error per prompt, matched by its text: the two requests run concurrently, and unmatched scripted
        # errors went to whichever arrived first (both could hit one request, which then ran out of retries).
        server.script(status(500, match="Today was a great day"), status(429, retry_after=0, match="Today was great"))
        rows = fn(["Today was"] * 3, completions, ids, env_rewards=[0.0, -1.0, 5.0])
        assert rewarded_text(tokenizer, ids[0], rows[0], +1) == "great"
        assert rewarded_text(tokenizer, ids[1], rows[1], +1) == "great"
        assert rows[2] is None
        assert len(server.received) == 4
        assert "Review: Today was a great day" in server.received[0].prompt + server.received[1].prompt + (
            server.received[2].prompt + server.received[3].prompt
        )
        m = fn.metrics()
        assert m["critic/retries"] == 2 and m["critic/successes"] == 2 and m["critic/prompt_tokens"] == 22
        assert m["critic/server_errors"] == 1 and m["critic/rate_limited"] == 1 and m["critic/attempts"] == 4
        assert m["critic/last_step_retries"] == 2 and m["critic/last_step_server_errors"] == 1
        for text in (caplog.text, repr(fn), str(m), str(cfg), str(dataclasses.asdict(cfg))):
            assert DUMMY_KEY not in text
        fn.close()


def test_openai_backend_unreachable_gives_zero_then_clear_error(tokenizer, monkeypatch):
    import socket

    monkeypatch.setenv("OPENAI_API_KEY", DUMMY_KEY)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = CriticRewardConfig(
        use_intrinsic_reward=True, critic_backend="openai", critic_base_url=f"http://127.0.0.1:{port}/v1",
        critic_timeout=1.0, critic_max_retries=0, max_consecutive_failing_steps=2,
    )  # fmt: skip
    fn = CriticIntrinsicReward(cfg, tokenizer)
    ids = encode(tokenizer, [" x"])
    assert fn(["p"], None, ids, env_rewards=[0.0]) == [None]
    with pytest.raises(CriticFailureError) as err:
        fn(["p"], None, ids, env_rewards=[0.0])
    assert DUMMY_KEY not in str(err.value) and "critic_base_url" in str(err.value)
    assert fn.metrics()["critic/connection_errors"] == 2


def test_transformers_critic_batched_and_restores_mode(tokenizer):
    model = build_causal_lm("qwen2", tokenizer, seed=0)
    model.train()
    critic = TransformersCritic(model, tokenizer, batch_size=2, max_new_tokens=4)
    prompts = ["Review: a great film", "Review: bad", "Review: the end"]
    answers = critic.generate(prompts)
    assert len(answers) == 3 and all(isinstance(a, str) for a in answers)
    assert model.training  # put back in train mode after generating
    m = critic.metrics()
    assert m["critic/attempts"] == 2 and m["critic/successes"] == 3
    one_by_one = TransformersCritic(model, tokenizer, batch_size=1, max_new_tokens=4).generate(prompts)
    assert one_by_one == answers  # left padding does not change greedy answers


def test_transformers_critic_as_intrinsic_reward_self_critique(tokenizer):
    model = build_causal_lm("qwen2", tokenizer, seed=0)
    cfg = CriticRewardConfig(use_intrinsic_reward=True, critic_backend="transformers", critic_max_tokens=6)
    fn = CriticIntrinsicReward(cfg, tokenizer, critic_model=model)
    assert isinstance(fn.backend, TransformersCritic) and fn.backend.max_prompt_length == 256 - 6
    ids = encode(tokenizer, [" a good day", " bad"])
    rows = fn(["p", "q"], None, ids, env_rewards=[0.0, 0.0])
    # A random tiny critic answers garbage: counted as unparseable, zero (None) reward, no crash.
    raw = fn.backend.generate([fn.critic_prompt(p, tokenizer.decode(i[:-1]), 0.0) for p, i in zip("pq", ids)])
    parsed = [parse_critic_answer(a) for a in raw]
    m = fn.metrics()
    assert m["critic/answers"] == 2 and m["critic/requests"] == 4  # 2 in the reward call, 2 here
    assert m["critic/unparseable"] == sum(not p.ok for p in parsed)
    for row, p, i in zip(rows, parsed, ids):
        assert (row is None) == (not p.ok)
        assert row is None or len(row) == len(i)


def test_transformers_critic_failure_is_counted(tokenizer):
    class Broken:
        training = False
        config = None

        def parameters(self):
            raise RuntimeError("out of memory")

    critic = TransformersCritic(Broken(), tokenizer, batch_size=2, max_prompt_length=16)
    assert critic.generate(["a", "b", "c"]) == [None, None, None]
    assert critic.metrics()["critic/failures"] == 3


def test_lexicon_critic_answers_parse_back():
    sent = LexiconCritic("sentiment").generate(["ignored"], ["Not bad at all, very funny, but the ending is dull."])[0]
    parsed = parse_critic_answer(sent)
    assert parsed.positive == ["Not bad", "very funny"] and parsed.negative == ["dull"]
    tox = LexiconCritic("toxicity").generate(["what a stupid idiot"])[0]
    assert parse_critic_answer(tox).negative == ["stupid idiot"]
    assert LexiconCritic("toxicity").generate(["nice weather"]) == ["Toxic Span: None identified"]


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"critic_task": "qa"}, "critic_task"),
        ({"critic_backend": "claude"}, "critic_backend"),
        ({"positive_reward_value": math.inf}, "positive_reward_value"),
        ({"intrinsic_reward_threshold": math.nan}, "intrinsic_reward_threshold"),
        ({"critic_concurrency": 0}, "critic_concurrency"),
        ({"critic_timeout": 0.0}, "critic_timeout"),
        ({"critic_max_retries": -1}, "critic_max_retries"),
        ({"max_consecutive_failing_steps": 0}, "max_consecutive_failing_steps"),
        ({"prompt_file": "/nonexistent/prompt.txt"}, "prompt_file"),
        ({"critic_rate_limit": -1.0}, "critic_rate_limit"),
        ({"critic_temperature": -0.1}, "critic_temperature"),
    ],
)
def test_config_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        CriticRewardConfig(**kw)


def test_summarization_needs_an_llm_backend_or_a_backend_object(tokenizer):
    cfg = CriticRewardConfig(use_intrinsic_reward=True, critic_task="summarization")  # the lexicon critic by default
    with pytest.raises(ValueError, match="critic_backend='lexicon' has no summarization lexicon"):
        CriticIntrinsicReward(cfg, tokenizer)
    # any backend object answers for any task, whatever critic_backend says
    critic = ScriptedCritic(lambda p: "Span 1: cat sat (Label: good)")
    fn = CriticIntrinsicReward(cfg, tokenizer, backend=critic)
    ids = encode(tokenizer, [" the cat sat"])
    (row,) = fn(["Post: a cat."], None, ids, env_rewards=[0.0])
    assert rewarded_text(tokenizer, ids[0], row, +1) == "catsat"


def test_config_fields_have_help():
    for f in dataclasses.fields(CriticRewardConfig):
        assert f.metadata.get("help"), f.name


def test_default_templates_are_package_data_and_prompts_folder_links_to_them():
    import os

    import trl_stable

    package_dir = os.path.dirname(os.path.abspath(trl_stable.__file__))
    repo_prompts = os.path.join(os.path.dirname(package_dir), "prompts")
    for task in ("sentiment", "toxicity", "summarization"):
        path = default_prompt_file(task)
        # inside the package (shipped by setup.cfg package_data), not the repository root
        assert os.path.dirname(path) == os.path.join(package_dir, "prompts") and os.path.isfile(path)
        assert CriticRewardConfig(critic_task=task, critic_backend="openai").resolved_prompt_file == path
        top = os.path.join(repo_prompts, f"critic_{task}.txt")
        if os.path.exists(top):  # a checkout: the user-facing copy is the same file, not a second source of truth
            assert os.path.samefile(top, path)


def test_api_key_not_in_saved_config(monkeypatch):
    import json

    monkeypatch.setenv("OPENAI_API_KEY", DUMMY_KEY)
    cfg = CriticRewardConfig(use_intrinsic_reward=True, critic_backend="openai", critic_base_url="http://127.0.0.1:9")
    fn = CriticIntrinsicReward(cfg, None)
    saved = json.dumps(dataclasses.asdict(cfg)) + repr(cfg) + repr(fn) + str(vars(fn)) + repr(fn.backend)
    assert DUMMY_KEY not in saved and "OPENAI_API_KEY" in saved  # the variable's name, never its value


def test_prompt_templates(tmp_path):
    for task in ("sentiment", "toxicity", "summarization"):
        template = load_critic_template(default_prompt_file(task))
        assert template.count("{}") == 1
    bad = tmp_path / "bad.txt"
    bad.write_text("no placeholder here")
    with pytest.raises(ValueError, match="placeholder"):
        load_critic_template(bad)
    # braces in examples and in the text survive; the text is inserted once
    assert fill_critic_template("a {x} {} b {score}", "t {} {score}", score=12.5) == "a {x} t {} {score} b 12.5"


def test_script_flags_with_relc_names():
    from transformers import HfArgumentParser

    flags = ["--use_instric_reward", "--critic_task", "toxicity", "--positive_reward_value", "0.0",
             "--negative_reward_value", "-0.5", "--intrinsic_reward_threshold", "1.0",
             "--prompt_file", default_prompt_file("toxicity")]  # fmt: skip
    from trl_stable.compat.relc_critic import RelcCriticRewardConfig

    (cfg,) = HfArgumentParser(RelcCriticRewardConfig).parse_args_into_dataclasses(flags)
    assert cfg.use_intrinsic_reward and cfg.critic_task == "toxicity"
    assert (cfg.positive_reward_value, cfg.negative_reward_value, cfg.intrinsic_reward_threshold) == (0.0, -0.5, 1.0)
    (cfg,) = HfArgumentParser(CriticRewardConfig).parse_args_into_dataclasses(["--use_intrinsic_reward"])
    assert cfg.use_intrinsic_reward


def test_prefetch_overlaps_and_pays_once(tokenizer, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", DUMMY_KEY)
    # the server holds the requests until the check right after prefetch: "nothing answered yet" cannot race
    with FakeOpenAIServer(answer=lambda p: "Identified Positive Text Span: great") as server:
        server.hold()
        cfg = CriticRewardConfig(
            use_intrinsic_reward=True, critic_backend="openai", critic_base_url=server.base_url,
            intrinsic_reward_threshold=1.0,
        )  # fmt: skip
        fn = CriticIntrinsicReward(cfg, tokenizer)
        completions = [" a great day", " great", " so great"]
        ids = encode(tokenizer, completions)
        env = [0.0, 0.5, 2.0]
        handle = fn.prefetch(["p"] * 3, ids, env_rewards=env)  # returns at once, the requests in flight
        assert fn.backend.metrics()["critic/successes"] == 0 and handle.selected == [0, 1]
        server.release()
        rows = fn(["p"] * 3, completions, ids, env_rewards=env, prefetched=handle)
        assert [rewarded_text(tokenizer, i, r, +1) if r else None for i, r in zip(ids, rows)] == [
            "great",
            "great",
            None,
        ]
        assert len(server.received) == 2  # the two critiqued samples, each asked once
        m = fn.metrics()
        # the call collected the prefetch's requests: asked, answered and counted once
        assert (m["critic/requests"], m["critic/successes"], m["critic/deduplicated"], m["critic/cache_hits"]) == (
            2,
            2,
            0,
            0,
        )
        assert m["critic/last_step_requests"] == 2
        assert m["critic/last_stage_seconds"] >= m["critic/last_wait_seconds"] >= 0
        fn.close()


def test_prefetch_of_another_batch_is_not_used(tokenizer, monkeypatch, caplog):
    monkeypatch.setenv("OPENAI_API_KEY", DUMMY_KEY)
    with FakeOpenAIServer(answer=lambda p: "Identified Positive Text Span: great") as server:
        cfg = CriticRewardConfig(
            use_intrinsic_reward=True, critic_backend="openai", critic_base_url=server.base_url,
            intrinsic_reward_threshold=1.0,
        )  # fmt: skip
        fn = CriticIntrinsicReward(cfg, tokenizer)
        completions = [" a great day", " great"]
        ids = encode(tokenizer, completions)
        handle = fn.prefetch(["p"] * 2, ids, env_rewards=[0.0, 0.0])
        expected = CriticIntrinsicReward(cfg, tokenizer, backend=fn.backend)(
            ["p"] * 2, completions, ids, env_rewards=[0.0, 2.0]
        )
        with caplog.at_level(logging.WARNING):
            rows = fn(["p"] * 2, completions, ids, env_rewards=[0.0, 2.0], prefetched=handle)
        assert "other completions or env_rewards than its prefetch" in caplog.text
        assert rows == expected and rows[1] is None  # the call's own env_rewards decide, not the prefetch's
        fn.close()


def test_prefetch_is_a_no_op_for_synchronous_backends(tokenizer):
    fn = CriticIntrinsicReward(CriticRewardConfig(use_intrinsic_reward=True), tokenizer)
    fn.prefetch(["p"], encode(tokenizer, [" good"]))
    assert fn.metrics()["critic/requests"] == 0


def openai_reward(tokenizer, server, **kw):
    fields = dict(
        use_intrinsic_reward=True, critic_backend="openai", critic_base_url=server.base_url,
        critic_model="tiny-critic", critic_timeout=2.0, critic_max_retries=1, intrinsic_reward_threshold=0.0,
    )  # fmt: skip
    fields.update(kw)
    fn = CriticIntrinsicReward(CriticRewardConfig(**fields), tokenizer)
    fn.backend.backoff_base = 0.01
    return fn


def test_every_backend_counter_is_logged_per_step_with_real_values(tokenizer, monkeypatch):
    from trl_stable.rewards.critic.counters import COUNTER_NAMES

    monkeypatch.setenv("OPENAI_API_KEY", DUMMY_KEY)
    with FakeOpenAIServer(answer=lambda p: "Identified Positive Text Span:\n[Span 1]: great") as server:
        fn = openai_reward(tokenizer, server, critic_timeout=0.5)
        # one fault per sample, matched by its word (requests run concurrently: no shared queue to race for)
        words = ["qalpha", "qbeta", "qgamma", "qdelta", "qepsilon", "qzeta", "qeta", "qtheta"]
        server.script(
            status(500, match="qalpha"), hang(5, match="qbeta"), malformed(match="qgamma"), drop(match="qdelta"),
            status(400, match="qepsilon"), reply("lorem ipsum", match="qzeta"),
            status(429, retry_after=0, match="qeta"),
        )  # fmt: skip
        completions = [f" a great {w}" for w in words]  # qtheta: answered at once
        ids = encode(tokenizer, completions)
        logged = {}
        rows = fn(["x"] * 8, completions, ids, env_rewards=[0.0] * 8, log_metric=logged.__setitem__)
        assert [r is None for r in rows] == [False, False, False, False, True, True, False, False]
        expected = dict.fromkeys(COUNTER_NAMES, 0)
        expected.update(
            requests=8, attempts=13, retries=5, successes=7, failures=1, server_errors=1, timeouts=1, bad_responses=1,
            connection_errors=1, client_errors=1, rate_limited=1, cache_refused=1, prompt_tokens=7 * 11,
            completion_tokens=7 * 7,
        )  # fmt: skip
        assert {k: logged[f"critic/step_{k}"] for k in COUNTER_NAMES} == expected
        assert logged["critic/step_unparseable"] == 1 and logged["critic/step_failed_answers"] == 1
        assert logged["critic/step_answers"] == 7 and logged["critic/step_critiqued"] == 8
        assert logged["critic/failed_fraction"] == 2 / 8 and logged["critic/request_failed_fraction"] == 1 / 8
        assert logged["critic/unparseable_fraction"] == 1 / 7
        assert sum(r.prompt.count("qbeta") > 0 for r in server.received) == 2  # the timed-out one was retried

        # the next step: the six parsed answers come from the cache; the garbage and the 400 are asked again
        logged.clear()
        fn(["x"] * 8, completions, ids, env_rewards=[0.0] * 8, log_metric=logged.__setitem__)
        assert logged["critic/step_cache_hits"] == 6 and logged["critic/step_attempts"] == 2
        assert logged["critic/step_requests"] == 8 and logged["critic/step_failures"] == 0
        assert logged["critic/step_unparseable"] == 0  # the healthy server's answer parses
        m = fn.metrics()
        assert m["critic/cache_hits"] == 6 and m["critic/last_step_cache_hits"] == 6 and m["critic/unparseable"] == 1
        fn.close()


@pytest.mark.parametrize("code", [401, 403])
def test_rejected_key_stops_the_run_at_the_first_step(tokenizer, monkeypatch, code):
    monkeypatch.setenv("MY_CRITIC_KEY", DUMMY_KEY)
    with FakeOpenAIServer(fault=lambda prompt, k: status(code, message=f"bad key {DUMMY_KEY}")) as server:
        fn = openai_reward(tokenizer, server, critic_api_key_env="MY_CRITIC_KEY", max_consecutive_failing_steps=5)
        ids = encode(tokenizer, [" a", " b", " c"])
        with pytest.raises(CriticFailureError) as err:
            fn(["p"] * 3, None, ids, env_rewards=[0.0] * 3)
        message = str(err.value)
        assert "MY_CRITIC_KEY" in message and server.base_url in message and f"HTTP {code}" in message
        assert DUMMY_KEY not in message
        assert "timeout" not in message and "rate" not in message  # it is about the key, not the network
        m = fn.metrics()
        assert m["critic/auth_errors"] >= 1 and m["critic/attempts"] <= 3 and m["critic/retries"] == 0
        assert m["critic/steps"] == 1  # the failing step is still recorded
        fn.close()


def test_checkpoint_state_continues_the_counters(tokenizer):
    """A critic restored from a checkpoint (through torch's safe loader) counts on from the saved counts: after the
    same calls its metrics are those of the critic that ran on (the backend's counters included)."""
    import io

    cfg = CriticRewardConfig(
        use_intrinsic_reward=True, intrinsic_reward_threshold=0.5, max_consecutive_failing_steps=3
    )
    completions = [" The plot was great but the ending was boring.", " It rained."]
    ids = encode(tokenizer, completions)
    straight = CriticIntrinsicReward(cfg, tokenizer, backend=ScriptedCritic(lambda p: None))  # every request fails
    straight(["p", "p"], completions, ids, env_rewards=[0.1, 0.2])
    buffer = io.BytesIO()
    torch.save(straight.checkpoint_state(), buffer)
    resumed = CriticIntrinsicReward(cfg, tokenizer, backend=ScriptedCritic(lambda p: None))
    buffer.seek(0)
    resumed.load_checkpoint_state(torch.load(buffer, weights_only=True))
    for fn in (straight, resumed):
        fn(["p", "p"], completions, ids, env_rewards=[0.1, 0.9])

    def counts(fn):
        return {k: v for k, v in fn.metrics().items() if "seconds" not in k}

    assert counts(resumed) == counts(straight)
    assert counts(resumed)["critic/requests"] == 3 and counts(resumed)["critic/steps"] == 2
    assert resumed.consecutive_failing_steps == 2  # the third failing step in a row raises, resumed or not
    with pytest.raises(CriticFailureError, match="3 consecutive steps"):
        resumed(["p"], completions[:1], ids[:1], env_rewards=[0.1])


@pytest.mark.parametrize(
    "fields, named, needs",
    [
        ({"critic_base_url": "https://user:URLKEY-77@h/v1"}, "critic_base_url", "critic_backend='openai'"),
        ({"critic_timeout": 5.0, "critic_rate_limit": 2.0}, "critic_timeout", "critic_backend='openai'"),
        ({"critic_model": "gpt-4o"}, "critic_model", "an LLM critic_backend"),
        ({"critic_backend": "openai", "critic_lexicon": "afinn"}, "critic_lexicon", "critic_backend='lexicon'"),
        (
            {"critic_backend": "transformers", "critic_model": "m", "critic_base_url": "http://h"},
            "critic_base_url",
            "",
        ),
        ({"critic_backend": "openai", "critic_batch_size": 4}, "critic_batch_size", "critic_backend='transformers'"),
    ],
)
def test_backend_fields_the_backend_ignores_are_named(tokenizer, monkeypatch, caplog, fields, named, needs):
    from trl_stable.settings.checks import check_dependents

    monkeypatch.setenv("OPENAI_API_KEY", DUMMY_KEY)
    if fields.get("critic_backend") == "transformers":
        monkeypatch.setattr("trl_stable.rewards.critic.factory.TransformersCritic", lambda *a, **kw: None)
    cfg = CriticRewardConfig(use_intrinsic_reward=True, **fields)  # the config alone: scripts pick the backend late
    with caplog.at_level(logging.WARNING):
        CriticIntrinsicReward(cfg, tokenizer)  # building the backend names what it ignores
    (warned,) = [r.getMessage() for r in caplog.records if "without it the run would ignore" in r.getMessage()]
    assert named in warned and needs in warned and "URLKEY-77" not in warned
    with pytest.raises(ValueError, match=named) as err:  # the shared rule, refusing
        check_dependents(cfg, cfg.backend_dependents())
    assert "URLKEY-77" not in str(err.value)


def test_a_backend_object_makes_the_backend_fields_moot_and_says_so(tokenizer, caplog):
    cfg = CriticRewardConfig(use_intrinsic_reward=True, critic_model="gpt-4o", critic_timeout=3.0)
    with caplog.at_level(logging.WARNING):
        CriticIntrinsicReward(cfg, tokenizer, backend=ScriptedCritic(lambda p: "None identified"))
    (record,) = [r for r in caplog.records if "ignored" in r.getMessage()]
    assert "critic_model='gpt-4o'" in record.getMessage() and "critic_timeout=3.0" in record.getMessage()
    assert "ScriptedCritic" in record.getMessage()


def test_a_disabled_critic_says_so_at_its_first_call(tokenizer, caplog):
    fn = CriticIntrinsicReward(CriticRewardConfig(), tokenizer)  # use_intrinsic_reward=False: no backend is built
    ids = encode(tokenizer, [" great"])
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            assert fn(["p"], [" great"], ids, env_rewards=[0.0]) == [None]
    warned = [r for r in caplog.records if "use_intrinsic_reward=False" in r.getMessage()]
    assert len(warned) == 1 and "critic_sentiment" in warned[0].getMessage()
