"""The NaN / None / inf contract of `trl_stable.rewards.dense`, on hand-made outputs."""

import math

import pytest
import torch

from trl_stable.monitoring.mismatch import behaviour_filter_metrics
from trl_stable.rewards.dense import (
    check_finite_rewards,
    collect_dense_rewards,
    sequence_reward_values,
    validate_dense_rewards,
    weighted_reward_sum,
)


def test_sequence_values_none_is_nan_and_inf_raises():
    out = sequence_reward_values([1.0, None, 2], 3, "f")
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == 2.0
    with pytest.raises(ValueError, match="'f' returned inf for completion 1"):
        sequence_reward_values([0.0, float("inf")], 2, "f")
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        sequence_reward_values([0.0], 2, "f")
    with pytest.raises(ValueError, match="'0.5'"):
        sequence_reward_values(["0.5"], 1, "f")


def test_weighted_sum_skips_nan_and_keeps_all_nan_rows_nan():
    nan = float("nan")
    rewards = torch.tensor([[1.0, 2.0], [nan, 3.0], [nan, nan]])
    out = weighted_reward_sum(rewards, [0.5, 2.0])
    assert out[0] == pytest.approx(0.5 + 4.0) and out[1] == pytest.approx(6.0) and math.isnan(out[2])


def test_check_finite_names_the_function():
    with pytest.raises(ValueError, match="'b' returned -inf for completion 1"):
        check_finite_rewards(torch.tensor([[0.0, 1.0], [0.0, -float("inf")]]), ["a", "b"])


def test_dense_rows_none_zero_nan_counted_inf_raises():
    assert validate_dense_rewards([None, [1, 2]], [3, 2]) == [[0.0, 0.0, 0.0], [1.0, 2.0]]
    with pytest.raises(ValueError, match="at token 1 of completion 0"):
        validate_dense_rewards([[0.0, float("inf")]], [2])
    with pytest.raises(ValueError, match="2 token rewards for completion 0, which has 3"):
        validate_dense_rewards([[0.0, 1.0]], [3])
    with pytest.raises(ValueError, match="float"):
        validate_dense_rewards(0.5, [1])


def test_collect_dense_rewards_weights_and_metrics():
    nan = float("nan")

    def first(**kwargs):
        return [[1.0, nan], None]

    def second(**kwargs):
        return [[0.5, 0.5], [2.0, 0.0, 1.0]]

    out = collect_dense_rewards(
        [first, second], ["first", "second"], [2.0, 1.0], [2, 3], call=lambda f: f(prompts=None)
    )
    assert out.rows == [[2.5, 0.5], [2.0, 0.0, 1.0]]
    assert out.metrics["rewards/first/nan_tokens"] == 1.0 and out.metrics["rewards/second/nan_tokens"] == 0.0
    # unweighted: first sums to 1 over 5 tokens (2 completions), second to 1 + 3
    assert out.metrics["rewards/first/token_mean"] == pytest.approx(1 / 5)
    assert out.metrics["rewards/second/sum_mean"] == pytest.approx(4 / 2)
    torch.testing.assert_close(out.as_tensor(), torch.tensor([[2.5, 0.5, 0.0], [2.0, 0.0, 1.0]]))


def test_behaviour_filter_metrics_hand_values():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    raw = torch.tensor([[0.5, 2.0, 9.0], [4.0, 1.0, 1.0]])
    keep = torch.tensor([[True, False, True], [True, True, True]])
    m = behaviour_filter_metrics(mask, raw, raw, keep, "icepop")
    assert m["behaviour_weight/mean"] == pytest.approx((0.5 + 2.0 + 4.0) / 3)
    assert m["behaviour_weight/max"] == 4.0 and m["behaviour_weight/min"] == 0.5
    assert m["token_filter/icepop/masked_token_frac"] == pytest.approx(1 / 3)
    assert m["token_filter/icepop/masked_seq_frac"] == pytest.approx(1 / 2)
    clamped = behaviour_filter_metrics(mask, raw, raw.clamp(max=3.0), None, "icepop")
    assert clamped["token_filter/icepop/clamped_token_frac"] == pytest.approx(1 / 3)
    # two "processes": the gathered rows are reduced as one batch
    both = behaviour_filter_metrics(mask, raw, raw, keep, "kpop", gather=lambda x: torch.cat([x, x]))
    assert both["token_filter/kpop/masked_token_frac"] == pytest.approx(1 / 3)
    empty = behaviour_filter_metrics(torch.zeros(1, 2), raw[:1, :2], raw[:1, :2], None, None)
    assert empty == {"behaviour_weight/mean": 1.0, "behaviour_weight/max": 1.0, "behaviour_weight/min": 1.0}
