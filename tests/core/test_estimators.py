"""The advantage-estimator registry: one signature, hand values / plain-python references for every estimator."""

import math

import pytest
import torch

from trl_stable.core import compute_gae, compute_turn_gae
from trl_stable.core.estimators import (
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    AdvantageOutputs,
    get_advantage_estimator,
    is_sequence_level,
    register_advantage_estimator,
)

REWARDS = [1.0, 0.0, 0.5, 2.0, 2.0, -1.0]
GROUPS = [0, 0, 0, 1, 1, 1]


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs, mean=None):
    mean = _mean(xs) if mean is None else mean
    return math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1))


def _groups(values, groups):
    out = {}
    for v, g in zip(values, groups, strict=True):
        out.setdefault(g, []).append(v)
    return out


def _run(name, **params):
    inputs = AdvantageInputs(torch.tensor(REWARDS, dtype=torch.float64), group_ids=torch.tensor(GROUPS))
    out = get_advantage_estimator(name)(inputs, **params)
    assert isinstance(out, AdvantageOutputs) and out.returns is None
    return out.advantages.tolist()


def test_registry_names_and_levels():
    assert set(ADVANTAGE_ESTIMATORS) >= {"grpo", "dr_grpo", "liteppo", "rloo", "gdpo", "ngrpo", "gae", "turn_gae"}
    assert is_sequence_level("rloo") and not is_sequence_level("gae") and not is_sequence_level("turn_gae")
    with pytest.raises(ValueError, match="Unknown advantage estimator 'nope'; registered: grpo"):
        get_advantage_estimator("nope")


def test_grpo_matches_a_python_loop():
    by_group = _groups(REWARDS, GROUPS)
    expected = [(r - _mean(by_group[g])) / (_std(by_group[g]) + 1e-4) for r, g in zip(REWARDS, GROUPS, strict=True)]
    assert _run("grpo") == pytest.approx(expected, abs=1e-12)
    # params override the preset: a batch mean, biased std
    biased = math.sqrt(sum((r - _mean(REWARDS)) ** 2 for r in REWARDS) / len(REWARDS))
    expected = [(r - _mean(REWARDS)) / (biased + 1e-6) for r in REWARDS]
    assert _run("grpo", mean_level="batch", std_level="batch", unbiased=False, eps=1e-6) == pytest.approx(expected)


def test_dr_grpo_and_rloo_by_hand():
    # group 0: mean 0.5; group 1: mean 1.0
    assert _run("dr_grpo") == pytest.approx([0.5, -0.5, 0.0, 1.0, 1.0, -2.0])
    # leave-one-out: 1 - (0 + 0.5)/2 = 0.75, 0 - 0.75 = -0.75, 0.5 - 0.5 = 0; 2 - 0.5 = 1.5 (twice), -1 - 2 = -3
    assert _run("rloo") == pytest.approx([0.75, -0.75, 0.0, 1.5, 1.5, -3.0])


def test_liteppo_group_mean_batch_std():
    centered = [0.5, -0.5, 0.0, 1.0, 1.0, -2.0]
    std = _std(centered, mean=0.0)  # the batch std around the group means (each group's centered mean is 0)
    assert _run("liteppo") == pytest.approx([c / (std + 1e-4) for c in centered])


def test_ngrpo_by_hand():
    # group [0, 0] plus one virtual 1.0: mean 1/3, std sqrt((1/9 + 1/9 + 4/9) / 2) = sqrt(1/3)
    out = get_advantage_estimator("ngrpo")(
        AdvantageInputs(torch.tensor([0.0, 0.0]), group_ids=torch.tensor([0, 0])), r_max=1.0, num_virtual=1, eps=0.0
    )
    assert out.advantages.tolist() == pytest.approx([-(1 / 3) / math.sqrt(1 / 3)] * 2)


def test_gdpo_matches_a_python_loop():
    per_func = [[1.0, 0.0], [0.0, 4.0], [1.0, 2.0], [3.0, 1.0], [1.0, 1.0], [2.0, 7.0]]
    weights = [1.0, 0.5]
    z = [[0.0, 0.0] for _ in per_func]
    for k in range(2):
        by_group = _groups([row[k] for row in per_func], GROUPS)
        for i, g in enumerate(GROUPS):
            z[i][k] = (per_func[i][k] - _mean(by_group[g])) / (_std(by_group[g]) + 1e-4)
    summed = [sum(w * zk for w, zk in zip(weights, row, strict=True)) for row in z]
    expected = [(s - _mean(summed)) / (_std(summed) + 1e-4) for s in summed]
    inputs = AdvantageInputs(
        torch.zeros(6),
        group_ids=torch.tensor(GROUPS),
        rewards_per_func=torch.tensor(per_func, dtype=torch.float64),
        reward_weights=torch.tensor(weights, dtype=torch.float64),
    )
    assert get_advantage_estimator("gdpo")(inputs).advantages.tolist() == pytest.approx(expected, abs=1e-10)
    with pytest.raises(ValueError, match="rewards_per_func"):
        get_advantage_estimator("gdpo")(AdvantageInputs(torch.zeros(6), group_ids=torch.tensor(GROUPS)))


def _gae_loop(rewards, values, mask, gamma, lam):
    """Plain-python GAE over the active positions of one row."""
    active = [t for t, m in enumerate(mask) if m]
    adv = [0.0] * len(rewards)
    next_value, next_adv = 0.0, 0.0
    for t in reversed(active):
        delta = rewards[t] + gamma * next_value - values[t]
        next_adv = delta + gamma * lam * next_adv
        adv[t] = next_adv
        next_value = values[t]
    return adv


def test_gae_wraps_compute_gae_and_matches_a_loop():
    rewards = [[0.0, 0.5, 0.0, 1.0], [0.2, 0.0, 0.0, 0.0]]
    values = [[0.1, 0.2, 0.9, 0.3], [0.5, 0.4, 0.0, 0.0]]
    mask = [[1, 1, 0, 1], [1, 1, 0, 0]]
    inputs = AdvantageInputs(torch.tensor(rewards), values=torch.tensor(values), mask=torch.tensor(mask))
    out = get_advantage_estimator("gae")(inputs, gamma=0.9, lam=0.8)
    expected = [_gae_loop(r, v, m, 0.9, 0.8) for r, v, m in zip(rewards, values, mask, strict=True)]
    assert out.advantages.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]
    reference = compute_gae(inputs.rewards, inputs.values, inputs.mask, 0.9, 0.8)
    assert torch.equal(out.advantages, reference[0]) and torch.equal(out.returns, reference[1])
    with pytest.raises(ValueError, match="'gae' estimator needs AdvantageInputs.values"):
        get_advantage_estimator("gae")(AdvantageInputs(torch.zeros(1, 2), mask=torch.ones(1, 2)))


def test_turn_gae_by_hand():
    # one row, two turns: turn 0 = tokens 0-1 (rewards 0 + 0), turn 1 = token 3 (reward 1); token 2 is tool output
    rewards = torch.tensor([[0.0, 0.0, 5.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 9.0, 0.25]])
    turn_ids = torch.tensor([[0, 0, -1, 1]])
    out = get_advantage_estimator("turn_gae")(
        AdvantageInputs(rewards, values=values, turn_ids=turn_ids), gamma=1.0, lam=1.0
    )
    # turn 1: A = 1 - 0.25 = 0.75; turn 0: delta = 0 + 0.25 - 0.5 = -0.25, A = -0.25 + 0.75 = 0.5
    assert out.advantages.tolist() == [[0.5, 0.5, 0.0, 0.75]]
    assert out.returns.tolist() == [[1.0, 1.0, 0.0, 1.0]]
    assert torch.equal(out.advantages, compute_turn_gae(rewards, values, turn_ids, 1.0, 1.0)[0])


def test_register_a_custom_estimator():
    @register_advantage_estimator("test_centered_only")
    def centered(inputs, shift=0.0):
        return AdvantageOutputs(inputs.rewards - inputs.rewards.mean() + shift)

    assert "test_centered_only" in ADVANTAGE_ESTIMATORS and is_sequence_level("test_centered_only")
    out = get_advantage_estimator("test_centered_only")(AdvantageInputs(torch.tensor([1.0, 3.0])), shift=1.0)
    assert out.advantages.tolist() == [0.0, 2.0]
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("grpo")(centered)
