"""Bad inputs to the critic reward are refused by name, before any critic request: an env_rewards entry that is no
number, a completion that is None, counts that differ; a None env reward is unscorable (NaN), counted, not an error."""

import math

import pytest

from trl_stable.rewards import CriticBackend, CriticIntrinsicReward, CriticRewardConfig
from trl_stable.rewards.dense import RewardContractError, RewardTypeError

try:
    from fake_openai_server import FakeOpenAIServer
except ImportError:
    from tests.rewards.fake_openai_server import FakeOpenAIServer

ANSWER = "Identified Positive Text Span: None identified"


class RecordingCritic(CriticBackend):
    """Answers every prompt alike and records what it was asked; `concurrent` makes `prefetch` start requests."""

    name = "recording"

    def __init__(self, concurrent=False):
        super().__init__()
        self.concurrent = concurrent
        self.prompts = []

    def generate(self, prompts, texts=None):
        self.prompts.extend(prompts)
        return [ANSWER] * len(prompts)


def reward(tokenizer, concurrent=False, threshold=1.0):
    critic = RecordingCritic(concurrent)
    cfg = CriticRewardConfig(use_intrinsic_reward=True, intrinsic_reward_threshold=threshold)
    return CriticIntrinsicReward(cfg, tokenizer, backend=critic), critic


def ids_of(tokenizer, texts):
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


COMPLETIONS = [" a", " b", " c"]


@pytest.mark.parametrize("concurrent", [False, True])
def test_a_none_env_reward_is_unscorable_and_counted(tokenizer, concurrent):
    fn, critic = reward(tokenizer, concurrent)
    ids = ids_of(tokenizer, COMPLETIONS)
    env = [0.0, None, 0.5]
    handle = fn.prefetch(["p"] * 3, ids, env_rewards=env, completions=COMPLETIONS)
    assert (handle is not None) == concurrent
    rows = fn(["p"] * 3, COMPLETIONS, ids, env_rewards=env, prefetched=handle)
    assert [r is not None for r in rows] == [True, False, True]  # None is NaN: never <= the threshold
    assert len(critic.prompts) == 2  # asked once per critiqued sample, the prefetch's requests collected
    assert fn.last_metrics["critic/step_nan_env_rewards"] == 1
    assert fn.metrics()["critic/nan_env_rewards"] == 1
    fn(["p"] * 3, COMPLETIONS, ids, env_rewards=[None, None, float("nan")])
    assert fn.metrics()["critic/nan_env_rewards"] == 4
    assert len(critic.prompts) == 2  # nothing critiqued in the second call


@pytest.mark.parametrize("bad", ["0.5", "high", [0.5], {"r": 1}, 1j])
@pytest.mark.parametrize("concurrent", [False, True])
def test_an_env_reward_that_is_no_number_is_refused_by_index(tokenizer, bad, concurrent):
    fn, critic = reward(tokenizer, concurrent)
    ids = ids_of(tokenizer, COMPLETIONS)
    env = [0.0, 0.0, bad]
    calls = [lambda: fn(["p"] * 3, COMPLETIONS, ids, env_rewards=env)]
    if concurrent:
        calls.append(lambda: fn.prefetch(["p"] * 3, ids, env_rewards=env, completions=COMPLETIONS))
    for call in calls:
        with pytest.raises(RewardTypeError) as err:
            call()
        message = str(err.value)
        assert "env_rewards[2]" in message and type(bad).__name__ in message
        assert "pass each completion's environment reward as a float (None or NaN where it has none)" in message
    assert critic.prompts == []  # refused before any critic request
    assert isinstance(err.value, TypeError)  # what callers catching the old TypeError still catch


@pytest.mark.parametrize("concurrent", [False, True])
def test_a_none_completion_is_refused_by_index_before_any_request(tokenizer, concurrent):
    fn, critic = reward(tokenizer, concurrent)
    ids = ids_of(tokenizer, COMPLETIONS)
    completions = [" a", None, " c"]
    calls = [lambda: fn(["p"] * 3, completions, ids, env_rewards=[0.0] * 3)]
    if concurrent:
        calls.append(lambda: fn.prefetch(["p"] * 3, ids, env_rewards=[0.0] * 3, completions=completions))
    for call in calls:
        with pytest.raises(RewardTypeError, match=r"completions\[1\]=None \(NoneType\) is no completion") as err:
            call()
        assert "pass its text (or its list of messages), the decoding of completion_ids[1]" in str(err.value)
    assert critic.prompts == []


def test_conversational_completions_and_none_for_the_list_are_accepted(tokenizer):
    fn, critic = reward(tokenizer)
    ids = ids_of(tokenizer, COMPLETIONS)
    messages = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    assert all(r is not None for r in fn(["p"] * 3, messages, ids, env_rewards=[0.0] * 3))
    assert all(r is not None for r in fn(["p"] * 3, None, ids, env_rewards=[0.0] * 3))
    assert len(critic.prompts) == 6


@pytest.mark.parametrize("concurrent", [False, True])
def test_completions_and_completion_ids_of_other_lengths_are_refused(tokenizer, concurrent):
    fn, critic = reward(tokenizer, concurrent)
    ids = ids_of(tokenizer, COMPLETIONS)
    calls = [lambda: fn(["p"] * 3, COMPLETIONS[:2], ids, env_rewards=[0.0] * 3)]
    if concurrent:
        calls.append(lambda: fn.prefetch(["p"] * 3, ids, env_rewards=[0.0] * 3, completions=COMPLETIONS[:2]))
    for call in calls:
        with pytest.raises(RewardContractError, match=r"completions has 2 entries but completion_ids has 3"):
            call()
    with pytest.raises(RewardContractError, match=r"env_rewards has 2 entries for 3 completions"):
        fn(["p"] * 3, COMPLETIONS, ids, env_rewards=[0.0, 0.0])
    assert critic.prompts == []


def test_bad_inputs_send_no_request_to_an_openai_compatible_server(tokenizer, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-DUMMY-bad-inputs-4e2a")
    with FakeOpenAIServer(answer=lambda p: ANSWER) as server:
        cfg = CriticRewardConfig(
            use_intrinsic_reward=True, critic_backend="openai", critic_base_url=server.base_url,
            intrinsic_reward_threshold=1.0,
        )  # fmt: skip
        fn = CriticIntrinsicReward(cfg, tokenizer)
        ids = ids_of(tokenizer, COMPLETIONS)
        with pytest.raises(RewardTypeError, match=r"env_rewards\[0\]"):
            fn.prefetch(["p"] * 3, ids, env_rewards=["bad", 0.0, 0.0], completions=COMPLETIONS)
        with pytest.raises(RewardTypeError, match=r"completions\[2\]"):
            fn(["p"] * 3, [" a", " b", None], ids, env_rewards=[0.0] * 3)
        assert server.received == [] and fn.metrics()["critic/requests"] == 0
        rows = fn(["p"] * 3, COMPLETIONS, ids, env_rewards=[0.0, None, math.nan])  # the same critic still works
        assert [r is not None for r in rows] == [True, False, False]
        assert len(server.received) == 1 and fn.metrics()["critic/nan_env_rewards"] == 2
        fn.close()
