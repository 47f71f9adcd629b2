"""The intrinsic-reward scale (`intrinsic_reward_coef`, `intrinsic_reward_max_sum`) and the AFINN lexicon critic
(`critic_lexicon="afinn"`): hand values, validation, RELC's setting unchanged."""

import math
import sys

import pytest

from trl_stable.rewards import (
    CriticBackend,
    CriticIntrinsicReward,
    CriticRewardConfig,
    LexiconCritic,
    parse_critic_answer,
    scale_intrinsic_rewards,
)
from trl_stable.rewards.critic.lexicon import afinn_lexicon, format_sentiment_answer


class FixedCritic(CriticBackend):
    name = "fixed"

    def __init__(self, positive, negative=()):
        super().__init__()
        self.answer = format_sentiment_answer(list(positive), list(negative))

    def generate(self, prompts, texts=None):
        self.counters.add("requests", len(prompts))
        return [self.answer for _ in prompts]


@pytest.mark.parametrize(
    "row, coef, bound, expected",
    [
        ([0.5, 0.0, -0.5], 1.0, None, [0.5, 0.0, -0.5]),  # RELC: unchanged
        ([0.5, 0.0, -0.5], 0.2, None, [0.1, 0.0, -0.1]),
        ([0.5, 0.5, 0.5, 0.5], 1.0, 1.0, [0.25, 0.25, 0.25, 0.25]),  # |sum| 2 -> 1
        ([0.5, 0.5, -0.5, 0.0], 1.0, 0.75, [0.25, 0.25, -0.25, 0.0]),  # absolute sum 1.5 -> 0.75, signs kept
        ([0.5, -0.5], 1.0, 2.0, [0.5, -0.5]),  # under the bound: unchanged
        ([0.5, 0.5, 0.5, 0.5], 0.5, 0.5, [0.125, 0.125, 0.125, 0.125]),  # coefficient first (sum 1), then bound
        ([0.5, -0.5], 0.0, 1.0, [0.0, 0.0]),
        ([], 1.0, 1.0, []),
    ],
)
def test_scale_intrinsic_rewards_hand_values(row, coef, bound, expected):
    assert scale_intrinsic_rewards(row, coef, bound) == pytest.approx(expected)


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"intrinsic_reward_coef": -0.1}, "intrinsic_reward_coef"),
        ({"intrinsic_reward_coef": math.nan}, "intrinsic_reward_coef"),
        ({"intrinsic_reward_coef": math.inf}, "intrinsic_reward_coef"),
        ({"intrinsic_reward_max_sum": 0.0}, "intrinsic_reward_max_sum"),
        ({"intrinsic_reward_max_sum": -1.0}, "intrinsic_reward_max_sum"),
        ({"intrinsic_reward_max_sum": math.inf}, "intrinsic_reward_max_sum"),
        ({"intrinsic_reward_max_sum": math.nan}, "intrinsic_reward_max_sum"),
        ({"critic_lexicon": "sentiwordnet"}, "critic_lexicon"),
        ({"critic_lexicon": "afinn", "critic_task": "toxicity"}, "critic_lexicon"),
    ],
)
def test_scale_and_lexicon_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        CriticRewardConfig(**kw)


def test_defaults_are_relc():
    cfg = CriticRewardConfig()
    assert (cfg.intrinsic_reward_coef, cfg.intrinsic_reward_max_sum, cfg.critic_lexicon) == (1.0, None, "vader")


def _rows(tokenizer, config, text, backend):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    reward = CriticIntrinsicReward(config, tokenizer, backend=backend)
    return ids, reward(prompts=[""], completions=[text], completion_ids=[ids], env_rewards=[0.0])[0], reward


def test_bound_scales_the_critic_row_and_is_counted(tokenizer):
    text = " great great great film, a dull end"
    relc = CriticRewardConfig(use_intrinsic_reward=True)
    _, raw, _ = _rows(tokenizer, relc, text, FixedCritic(["great great great"], ["dull"]))
    n_pos, n_neg = sum(v == 0.5 for v in raw), sum(v == -0.5 for v in raw)
    assert n_pos >= 3 and n_neg >= 1 and set(raw) <= {0.5, -0.5, 0.0}  # RELC's +-0.5, unscaled
    bounded = CriticRewardConfig(use_intrinsic_reward=True, intrinsic_reward_max_sum=1.0)
    _, row, reward = _rows(tokenizer, bounded, text, FixedCritic(["great great great"], ["dull"]))
    total = 0.5 * (n_pos + n_neg)
    assert row == pytest.approx([v / total for v in raw])  # each token 0.5 / total: proportions and signs kept
    assert sum(abs(v) for v in row) == pytest.approx(1.0)
    assert reward.metrics()["critic/samples_bounded"] == 1.0
    half = CriticRewardConfig(use_intrinsic_reward=True, intrinsic_reward_coef=0.5)
    _, row, reward = _rows(tokenizer, half, text, FixedCritic(["great great great"], ["dull"]))
    assert row == pytest.approx([0.5 * v for v in raw]) and reward.metrics()["critic/samples_bounded"] == 0.0


def test_afinn_lexicon_critic_hand_spans():
    critic = LexiconCritic("sentiment", lexicon="afinn")
    answer = critic.generate(["x"], ["Not bad at all, so funny, but the ending is dull and I can't love it."])[0]
    parsed = parse_critic_answer(answer)
    # AFINN: bad -3 (negated: +), funny +4, dull -2, love +3 (negated by "can't": -); no boosters ("so" stays out)
    assert parsed.positive == ["Not bad", "funny"] and parsed.negative == ["dull", "can't love"]
    spans = critic.scored_spans("a wonderful, boring film")
    assert [(s, e, v) for s, e, v in spans] == [(2, 11, 4.0), (13, 19, -3.0)]
    assert afinn_lexicon()["wonderful"] == 4.0 and "does not work" not in afinn_lexicon()


def test_afinn_critic_reads_no_vader_list(monkeypatch):
    monkeypatch.setitem(sys.modules, "vaderSentiment", None)  # any import of VADER now fails
    monkeypatch.setitem(sys.modules, "vaderSentiment.vaderSentiment", None)
    critic = LexiconCritic("sentiment", lexicon="afinn")
    assert parse_critic_answer(critic.generate(["x"], ["a great film"])[0]).positive == ["great"]
    with pytest.raises(ImportError):
        LexiconCritic("sentiment", lexicon="vader")


def test_lexicon_critic_rejects_unknown_lexicon():
    with pytest.raises(ValueError, match="lexicon"):
        LexiconCritic("sentiment", lexicon="nrc")


def test_config_builds_the_afinn_backend(tokenizer):
    cfg = CriticRewardConfig(use_intrinsic_reward=True, critic_lexicon="afinn")
    reward = CriticIntrinsicReward(cfg, tokenizer)
    assert isinstance(reward.backend, LexiconCritic) and reward.backend.lexicon == "afinn"
    text = " a beautiful film"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    row = reward(prompts=[""], completions=[text], completion_ids=[ids], env_rewards=[0.0])[0]
    rewarded = "".join(tokenizer.decode([t]) for t, v in zip(ids, row) if v > 0).strip()
    assert rewarded == "beautiful"
