import math
import threading

import pytest
import torch

from trl_stable.core import (
    NORMALIZATION_PRESETS,
    AdvantageInputs,
    gdpo_advantages,
    gdpo_scores,
    get_advantage_estimator,
    normalize,
)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def test_batch_batch_hand_values():
    x = t(1.0, 2.0, 3.0, 6.0)  # mean 3, SS = 4+1+0+9 = 14, unbiased std = sqrt(14/3)
    out = normalize(x, eps=0.0)
    std = math.sqrt(14 / 3)
    torch.testing.assert_close(out, t(-2 / std, -1 / std, 0.0, 3 / std))


def test_group_group_unequal_sizes_and_group_of_one():
    x = t(1.0, 3.0, 10.0, 20.0, 30.0, 7.0)
    g = torch.tensor([0, 0, 1, 1, 1, 2])
    out = normalize(x, g, mean_level="group", std_level="group", eps=0.0)
    # group 0: mean 2, std sqrt(2); group 1: mean 20, std 10; group 2 (one sample): mean 7, std 1
    expected = t(-1 / math.sqrt(2), 1 / math.sqrt(2), -1.0, 0.0, 1.0, 0.0)
    torch.testing.assert_close(out, expected)


def test_biased_std_and_eps():
    x = t(0.0, 2.0)
    out = normalize(x, torch.tensor([5, 5]), mean_level="group", std_level="group", unbiased=False, eps=0.5)
    # mean 1, biased std 1 -> (x - 1) / 1.5
    torch.testing.assert_close(out, t(-1 / 1.5, 1 / 1.5))


def test_dr_grpo_no_std_ignores_eps():
    x = t(1.0, 3.0, 5.0, 5.0)
    g = torch.tensor([0, 0, 1, 1])
    out = normalize(x, g, eps=123.0, **NORMALIZATION_PRESETS["dr_grpo"])
    torch.testing.assert_close(out, t(-1.0, 1.0, 0.0, 0.0))


def test_liteppo_group_mean_batch_std_around_group_means():
    x = t(1.0, 3.0, 10.0, 14.0)
    g = torch.tensor([0, 0, 1, 1])
    out = normalize(x, g, eps=0.0, **NORMALIZATION_PRESETS["liteppo"])
    # centered: -1, 1, -2, 2 ; SS = 10 ; std = sqrt(10/3)
    std = math.sqrt(10 / 3)
    torch.testing.assert_close(out, t(-1 / std, 1 / std, -2 / std, 2 / std))


def test_rloo_leave_one_out():
    x = t(1.0, 2.0, 6.0, 4.0, 8.0)
    g = torch.tensor([0, 0, 0, 1, 2])
    out = normalize(x, g, **NORMALIZATION_PRESETS["rloo"])
    # group 0: baselines (2+6)/2=4, (1+6)/2=3.5, (1+2)/2=1.5; groups of one: baseline 0
    torch.testing.assert_close(out, t(-3.0, -1.5, 4.5, 4.0, 8.0))


def test_all_equal_group_gives_zero():
    x = t(0.5, 0.5, 0.5, 1.0, 0.0)
    g = torch.tensor([0, 0, 0, 1, 1])
    out = normalize(x, g, mean_level="group", std_level="group", eps=1e-5)
    assert torch.all(out[:3] == 0)
    assert torch.all(torch.isfinite(out))


def test_mean_none_std_batch_is_rms_scaling():
    x = t(3.0, -3.0, 3.0, -3.0)
    out = normalize(x, mean_level=None, std_level="batch", eps=0.0)
    std = math.sqrt(36 / 3)
    torch.testing.assert_close(out, x / std)


def test_nan_entries_are_missing():
    x = t(1.0, float("nan"), 3.0, 2.0, 4.0)
    g = torch.tensor([0, 0, 0, 1, 1])
    out = normalize(x, g, mean_level="group", std_level="group", eps=0.0)
    assert math.isnan(out[1])
    # group 0 is {1, 3}: mean 2, std sqrt(2)
    torch.testing.assert_close(
        out[[0, 2, 3, 4]], t(-1 / math.sqrt(2), 1 / math.sqrt(2), -1 / math.sqrt(2), 1 / math.sqrt(2))
    )


def test_matches_trl_group_formula():
    from trl.trainer.utils import nanstd

    torch.manual_seed(0)
    rewards = torch.rand(12)
    groups = rewards.view(-1, 4)
    expected = (rewards - groups.mean(1).repeat_interleave(4)) / (nanstd(groups, dim=1).repeat_interleave(4) + 1e-4)
    out = normalize(rewards, torch.arange(12) // 4, mean_level="group", std_level="group", eps=1e-4)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"mean_level": "prompt"}, "mean_level"),
        ({"std_level": "seq"}, "std_level"),
        ({"mean_level": None, "leave_one_out": True}, "leave_one_out"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        normalize(t(1.0, 2.0), **kwargs)


def test_leave_one_out_with_group_std_around_the_loo_means():
    x = t(1.0, 2.0, 6.0, 5.0)
    g = torch.tensor([0, 0, 0, 1])
    out = normalize(x, g, mean_level="group", std_level="group", leave_one_out=True, eps=0.0)
    # group 0: baselines 4, 3.5, 1.5 -> centred -3, -1.5, 4.5; SS = 31.5, unbiased std sqrt(15.75)
    # group 1 (one sample): baseline 0, std 1
    s = math.sqrt(15.75)
    torch.testing.assert_close(out, t(-3 / s, -1.5 / s, 4.5 / s, 5.0))


def test_no_mean_group_std_and_a_group_of_one():
    x = t(3.0, -3.0, 2.0)
    out = normalize(x, torch.tensor([7, 7, 9]), mean_level=None, std_level="group", eps=0.0)
    # group 7: std around 0 = sqrt((9 + 9) / 1); group 9: one sample, std 1
    torch.testing.assert_close(out, t(3 / math.sqrt(18), -3 / math.sqrt(18), 2.0))


# ---------------------------------------------------------------- GDPO
def test_gdpo_scores_hand_values():
    # column 0: valid [1, 3] -> mean 2, unbiased std sqrt(2); column 1: [10, 30, 20] -> mean 20, std 10
    nan = float("nan")
    rewards = torch.tensor([[1.0, 10.0], [3.0, 30.0], [nan, 20.0], [nan, nan]])
    scores = gdpo_scores(rewards, [1.0, 0.5], eps=0.0)
    half = 2**-0.5
    torch.testing.assert_close(scores[:3], torch.tensor([-half - 0.5, half + 0.5, 0.0]))
    assert torch.isnan(scores[3])  # no reward applies: stays NaN (the trainer drops the sample)
    # eps enters the denominator of every column
    with_eps = gdpo_scores(rewards[:2], eps=1.0)
    # [1, 3]: std sqrt(2); [10, 30]: std sqrt(200); 1 / (sqrt(2) + 1) + 10 / (sqrt(200) + 1) = 1.074627
    torch.testing.assert_close(with_eps, torch.tensor([-1.074627, 1.074627]))


def test_gdpo_scores_rescaling_one_reward_changes_nothing():
    # the point of normalising before the sum: a reward's unit (x1000) no longer decides the score
    rewards = torch.tensor([[0.0, 1.0], [1.0, 3.0], [1.0, 2.0], [0.0, 5.0]])
    scaled = rewards * torch.tensor([1000.0, 1.0])
    torch.testing.assert_close(gdpo_scores(rewards, eps=0.0), gdpo_scores(scaled, eps=0.0))


def test_gdpo_scores_one_valid_sample_gets_zero_and_bad_weights_raise():
    nan = float("nan")
    torch.testing.assert_close(gdpo_scores(torch.tensor([[4.0], [nan]]))[:1], torch.tensor([0.0]))
    with pytest.raises(ValueError, match="one weight per reward function"):
        gdpo_scores(torch.ones(3, 2), [1.0])


def test_gdpo_scores_over_two_processes_equal_the_global_batch():
    # a fake all-reduce between two threads: each "process" holds half the batch
    nan = float("nan")
    rewards = torch.tensor([[1.0, 10.0], [3.0, 30.0], [nan, 20.0], [5.0, 0.0]])
    barrier, slots, out = threading.Barrier(2), [None, None], [None, None]

    def run(rank):
        def reduce_sum(t):
            slots[rank] = t
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()  # both have read before the next call overwrites the slots
            return total

        out[rank] = gdpo_scores(rewards[2 * rank : 2 * rank + 2], [2.0, 1.0], reduce_sum=reduce_sum)

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(torch.cat(out), gdpo_scores(rewards, [2.0, 1.0]))


def test_gdpo_hand_values():
    rewards = t(1.0, 10.0, 3.0, 30.0, 0.0, 5.0, 0.0, 5.0).view(4, 2)
    g = torch.tensor([0, 0, 1, 1])
    out = gdpo_advantages(rewards, g, weights=[1.0, 2.0], eps=0.0)
    # group 0: col0 {1,3} -> -1/sqrt2, 1/sqrt2 ; col1 {10,30} -> same ; group 1 all equal -> 0
    s = 3 / math.sqrt(2)
    summed = t(-s, s, 0.0, 0.0)
    std = math.sqrt((2 * s**2) / 3)
    torch.testing.assert_close(out, summed / std)


def test_gdpo_matches_trl_normalize_then_sum_formula():
    from trl.trainer.utils import nanstd

    torch.manual_seed(0)
    rewards = torch.rand(8, 3)
    weights = torch.tensor([0.5, 1.0, 2.0])
    grouped = rewards.view(-1, 4, 3)
    z = ((grouped - grouped.mean(1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)).view(-1, 3)
    s = (z * weights).sum(1)
    expected = (s - s.mean()) / (nanstd(s) + 1e-4)
    torch.testing.assert_close(gdpo_advantages(rewards, torch.arange(8) // 4, weights), expected)


def test_gdpo_weights_wrong_length():
    with pytest.raises(ValueError, match="weights has 3 entries"):
        gdpo_advantages(torch.zeros(4, 2), torch.zeros(4, dtype=torch.long), weights=[1.0, 1.0, 1.0])


def test_gdpo_nan_column_entries():
    rewards = t(1.0, float("nan"), 3.0, float("nan"), float("nan"), float("nan"), 2.0, 2.0).view(4, 2)
    out = gdpo_advantages(rewards, torch.zeros(4, dtype=torch.long), eps=0.0)
    assert math.isnan(out[2])
    assert torch.all(torch.isfinite(out[[0, 1, 3]]))


def test_gdpo_scores_within_groups_hand_values():
    # group 0 rows 0-2, group 1 rows 3-4; column 0: {1, 3, nan} -> mean 2, std sqrt(2); {5, 5} -> std 0, z 0
    # column 1: {0, 6, 3} -> mean 3, std 3; {2, 4} -> mean 3, std sqrt(2)
    nan = float("nan")
    rewards = torch.tensor([[1.0, 0.0], [3.0, 6.0], [nan, 3.0], [5.0, 2.0], [5.0, 4.0]], dtype=torch.float64)
    scores = gdpo_scores(rewards, [2.0, 1.0], eps=0.0, group_ids=torch.tensor([7, 7, 7, 9, 9]))
    r2 = math.sqrt(2)
    expected = t(2 * -1 / r2 - 1.0, 2 * 1 / r2 + 1.0, 0.0, -1 / r2, 1 / r2)
    torch.testing.assert_close(scores, expected)


def test_gdpo_scores_are_the_weighted_sum_of_normalize_per_reward():
    # an independent route: `normalize` of each column (NaN-aware) and the weighted sum, NaN counted as 0
    torch.manual_seed(0)
    rewards = torch.randn(12, 3, dtype=torch.float64) * torch.tensor([1.0, 100.0, 0.01], dtype=torch.float64)
    rewards[torch.rand(12, 3) < 0.25] = float("nan")
    weights = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    group_ids = torch.arange(12) // 4
    for groups, level in ((None, "batch"), (group_ids, "group")):
        columns = [
            normalize(rewards[:, j], groups, mean_level=level, std_level=level, eps=1e-4).nan_to_num(0.0)
            for j in range(3)
        ]
        expected = (torch.stack(columns, 1) * weights).sum(1)
        expected[torch.isnan(rewards).all(1)] = float("nan")
        torch.testing.assert_close(gdpo_scores(rewards, weights, group_ids=groups), expected, equal_nan=True)


def _gdpo_by_hand(rows, weights, eps=1e-4):
    """GDPO with the whole batch as one group, in plain Python: per-reward z-scores, weighted sum (NaN: skipped)."""
    columns = []
    for j in range(len(weights)):
        xs = [row[j] for row in rows if not math.isnan(row[j])]
        mean = sum(xs) / len(xs)
        std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
        columns.append((mean, std))
    return [
        sum(
            w * (row[j] - m) / (s + eps)
            for j, (w, (m, s)) in enumerate(zip(weights, columns))
            if not math.isnan(row[j])
        )
        for row in rows
    ]


def test_ppo_gdpo_scores_are_grpo_gdpo_of_one_group_before_its_batch_z_score():
    # PPO (one response per prompt, the batch is the group) and GRPO's "gdpo" estimator mean the same thing when GRPO's
    # batch is one group, except GRPO's final z-score of the sum
    nan = float("nan")
    rows = [[1.0, 10.0], [3.0, 30.0], [nan, 20.0], [5.0, 0.0], [2.0, 25.0]]
    weights = [2.0, 1.0]
    rewards = torch.tensor(rows, dtype=torch.float64)
    ppo = gdpo_scores(rewards, weights)
    torch.testing.assert_close(ppo, t(*_gdpo_by_hand(rows, weights)))
    inputs = AdvantageInputs(
        torch.zeros(5),
        group_ids=torch.zeros(5, dtype=torch.long),
        rewards_per_func=rewards,
        reward_weights=t(*weights),
    )
    grpo = get_advantage_estimator("gdpo")(inputs).advantages
    mean = sum(_gdpo_by_hand(rows, weights)) / 5
    std = math.sqrt(sum((s - mean) ** 2 for s in _gdpo_by_hand(rows, weights)) / 4)
    torch.testing.assert_close(grpo, (ppo - mean) / (std + 1e-4))
    torch.testing.assert_close(grpo, gdpo_advantages(rewards, torch.zeros(5, dtype=torch.long), weights))


def test_gdpo_scores_refuse_reduce_sum_with_groups():
    with pytest.raises(ValueError, match="reduce_sum only with group_ids=None"):
        gdpo_scores(torch.ones(4, 1), reduce_sum=lambda x: x, group_ids=torch.tensor([0, 0, 1, 1]))
