import math

import pytest
import torch

from trl_stable.core import (
    dense_advantages,
    ngrpo_advantages,
    overlong_penalty,
    reward_to_go,
    zero_variance_groups,
)


def t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


# ---------------------------------------------------------------- NGRPO
def test_ngrpo_all_zero_group_of_eight():
    out = ngrpo_advantages(torch.zeros(8, dtype=torch.float64), torch.zeros(8, dtype=torch.long))
    torch.testing.assert_close(out, torch.full((8,), -1 / 3, dtype=torch.float64), atol=1e-5, rtol=0)


def test_ngrpo_group_at_rmax_keeps_zero():
    out = ngrpo_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long))
    assert torch.all(out == 0)


def test_ngrpo_worked_example():
    # four 0.8s + a virtual 1.0: mean 0.84, SS = 4*0.04^2 + 0.16^2 = 0.032, std = sqrt(0.032/4)
    out = ngrpo_advantages(t(0.8, 0.8, 0.8, 0.8), torch.zeros(4, dtype=torch.long), eps=0.0)
    expected = (0.8 - 0.84) / math.sqrt(0.032 / 4)
    torch.testing.assert_close(out, torch.full((4,), expected, dtype=torch.float64))
    assert torch.all(out < 0)


def test_ngrpo_unequal_groups_group_of_one_and_two_virtuals():
    r = t(0.0, 1.0, 0.5, 0.0)
    g = torch.tensor([0, 0, 1, 2])
    out = ngrpo_advantages(r, g, r_max=1.0, num_virtual=2, eps=0.0)
    # group 0: {0, 1, 1, 1}: mean .75, SS = .5625 + 3*.0625 = .75, std = .5 -> -1.5, .5
    # group 1: {.5, 1, 1}: mean 5/6, SS = 1/9 + 2/36 = 1/6, std = sqrt(1/12)
    # group 2: {0, 1, 1}: mean 2/3, SS = 4/9 + 2/9 = 2/3, std = sqrt(1/3)
    expected = t(-1.5, 0.5, (0.5 - 5 / 6) / math.sqrt(1 / 12), (0 - 2 / 3) / math.sqrt(1 / 3))
    torch.testing.assert_close(out, expected)


def test_ngrpo_nan_and_bad_num_virtual():
    out = ngrpo_advantages(t(0.0, float("nan"), 0.0), torch.zeros(3, dtype=torch.long), eps=0.0)
    assert math.isnan(out[1])
    # {0, 0, 1}: mean 1/3, std sqrt(1/3)
    torch.testing.assert_close(out[0], torch.tensor(-(1 / 3) / math.sqrt(1 / 3), dtype=torch.float64))
    with pytest.raises(ValueError, match="num_virtual"):
        ngrpo_advantages(t(0.0, 1.0), torch.zeros(2, dtype=torch.long), num_virtual=0)


# ---------------------------------------------------------------- overlong penalty
def test_overlong_penalty_ramp():
    out = overlong_penalty(torch.tensor([10, 16, 18, 20]), max_length=20, overlong_tokens=4, factor=1.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.5, -1.0]))
    out = overlong_penalty(torch.tensor([17]), max_length=20, overlong_tokens=4, factor=2.0)
    torch.testing.assert_close(out, torch.tensor([-0.5]))
    with pytest.raises(ValueError, match="overlong_tokens"):
        overlong_penalty(torch.tensor([1]), max_length=4, overlong_tokens=5)


# ---------------------------------------------------------------- dynamic sampling
def test_zero_variance_groups():
    r = t(1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 5.0, float("nan"))
    g = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert zero_variance_groups(r, g).tolist() == [True, True, False, False, True, True, True, True]


# ---------------------------------------------------------------- dense
def test_reward_to_go_undiscounted_and_masked():
    r = t(1.0, 2.0, 3.0, 4.0, 0.5, 0.5, 9.0, 9.0).view(2, 4)
    m = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    out = reward_to_go(r, m)
    torch.testing.assert_close(out, t(10.0, 9.0, 7.0, 4.0, 1.0, 0.5, 0.0, 0.0).view(2, 4))


def test_reward_to_go_discounted_skips_masked_steps():
    r = t(1.0, 5.0, 1.0, 1.0).view(1, 4)
    m = torch.tensor([[1, 0, 1, 1]])  # position 1 is a tool token: no reward, no time step
    out = reward_to_go(r, m, gamma=0.5)
    torch.testing.assert_close(out, t(1 + 0.5 * 1.5, 0.0, 1.5, 1.0).view(1, 4))


def test_dense_advantages():
    seq = t(1.0, -1.0)
    dense = t(0.0, 0.5, 0.0, 0.0, 0.0, -1.0).view(2, 3)
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = dense_advantages(seq, dense, m, coef=2.0)
    torch.testing.assert_close(out, t(2.0, 2.0, 1.0, -1.0, -1.0, 0.0).view(2, 3))
