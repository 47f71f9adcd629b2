"""The NaN / None / inf contract of `trl_stable.rewards.dense`, on hand-made outputs."""

import math

import pytest
import torch

from trl_stable.monitoring.mismatch import behaviour_filter_metrics
from trl_stable.rewards.dense import (
    RewardContractError,
    RewardTypeError,
    bound_rewards,
    checked_sequence_reward,
    collect_dense_rewards,
    sequence_reward_values,
    validate_dense_rewards,
    weighted_reward_sum,
)


def test_sequence_values_none_nan_and_inf_do_not_apply(caplog):
    out = sequence_reward_values([1.0, None, 2], 3, "f")
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == 2.0
    out = sequence_reward_values([0.0, float("inf"), -float("inf"), 1e39, float("nan")], 5, "f")
    assert out[:4].tolist() == [0.0, math.inf, -math.inf, math.inf] and math.isnan(out[4])  # 1e39: beyond float32
    with caplog.at_level("WARNING"):  # the bound, applied to every function's values at once, makes them NaN
        bounded, counts = bound_rewards(out[:, None], ["f"])
    assert bounded[0, 0] == 0.0 and all(math.isnan(v) for v in bounded[1:, 0].tolist()) and counts.tolist() == [3]
    assert "'f' returned inf for completion 1 (and 2 more" in caplog.text
    with pytest.raises(RewardContractError, match="returned 1 values for 2 completions"):
        sequence_reward_values([0.0], 2, "f")
    with pytest.raises(TypeError, match="'f' returned '0.5' \\(str\\) for completion 0"):
        sequence_reward_values(["0.5"], 1, "f")


def test_weighted_sum_skips_nan_and_keeps_all_nan_rows_nan():
    nan = float("nan")
    rewards = torch.tensor([[1.0, 2.0], [nan, 3.0], [nan, nan]])
    out = weighted_reward_sum(rewards, [0.5, 2.0])
    assert out[0] == pytest.approx(0.5 + 4.0) and out[1] == pytest.approx(6.0) and math.isnan(out[2])


def test_infinite_model_rewards_become_nan(caplog):
    rewards = torch.tensor([[0.0, 1.0], [0.0, -float("inf")]])
    with caplog.at_level("WARNING"):
        out, counts = bound_rewards(rewards, ["a", "b"], None)
    assert "'b' returned -inf for completion 1" in caplog.text
    assert out[1, 0] == 0.0 and math.isnan(out[1, 1]) and out[0].tolist() == [0.0, 1.0]
    assert counts.tolist() == [0, 1]
    finite = torch.tensor([[0.0, math.nan]])
    assert bound_rewards(finite, ["a", "b"])[0] is finite  # nothing to do: TRL's tensor itself


def test_dense_rows_none_zero_nan_and_inf_do_not_apply():
    assert validate_dense_rewards([None, [1, 2]], [3, 2]) == [[0.0, 0.0, 0.0], [1.0, 2.0]]
    row = validate_dense_rewards([[0.0, float("inf"), None]], [3])[0]
    assert row[0] == 0.0 and math.isnan(row[1]) and math.isnan(row[2])
    with pytest.raises(RewardContractError, match="2 token rewards for completion 0, which has 3"):
        validate_dense_rewards([[0.0, 1.0]], [3])
    with pytest.raises(TypeError, match="returned 0.5 \\(float\\); return one list"):
        validate_dense_rewards(0.5, [1])
    with pytest.raises(TypeError, match="token 1 of completion 0"):
        validate_dense_rewards([[0.0, "1"]], [2])


def test_contract_errors_are_value_or_type_errors():
    # a count is a ValueError, a type a TypeError; both are RewardContractError, raised on every process
    assert issubclass(RewardTypeError, TypeError) and issubclass(RewardTypeError, RewardContractError)
    assert issubclass(RewardContractError, ValueError)


def test_checked_sequence_reward_defers_the_error():
    """TRL's caller gathers after the reward functions: a broken answer becomes None rows and the error is kept, so
    every process reaches that gather before the error is raised on all of them."""
    errors = []
    checked = checked_sequence_reward(lambda **kw: ["0.5", 1.0], "f", errors, is_async=False)
    assert checked(prompts=["a", "b"], completions=["x", "y"]) == [None, None]
    assert len(errors) == 1 and "'f' returned '0.5'" in str(errors[0])
    fine = checked_sequence_reward(lambda **kw: [None, 1, float("inf")], "f", errors, is_async=False)
    out = fine(prompts=["a", "b", "c"])
    # None -> NaN; inf stays inf here, for the bound that `bound_rewards` applies to every function at once
    assert out[0] != out[0] and out[1] == 1.0 and out[2] == math.inf and len(errors) == 1


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
