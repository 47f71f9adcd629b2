import pytest
import torch

from trl_stable.core.gae import compute_gae, compute_turn_gae, count_turns, relative_position_lambda, vapo_lambda


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_gae_hand_values():
    # gamma 1, lam 0.5: A2 = 2; A1 = (0 + 0 - 1) + 0.5 * 2 = 0; A0 = (1 + 1 - 0.5) + 0.5 * 0 = 1.5
    adv, ret = compute_gae(_t([[1, 0, 2]]), _t([[0.5, 1.0, 0.0]]), torch.ones(1, 3), gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, _t([[1.5, 0.0, 2.0]]))
    torch.testing.assert_close(ret, _t([[2.0, 1.0, 2.0]]))


def test_gae_masked_positions_consume_no_step():
    # same sequence as above with a junk position inserted at index 1 (mask 0): identical advantages elsewhere
    mask = _t([[1, 0, 1, 1]])
    adv, ret = compute_gae(_t([[1, 9, 0, 2]]), _t([[0.5, 7, 1.0, 0.0]]), mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, _t([[1.5, 0.0, 0.0, 2.0]]))
    torch.testing.assert_close(ret, _t([[2.0, 0.0, 1.0, 2.0]]))


def test_gae_per_sequence_lambda_gamma_and_bootstrap():
    rewards, values = _t([[0, 1], [0, 1]]), _t([[1, 2], [1, 2]])
    # row 0 (lam .5, bootstrap 3): A1 = 1 + .5*3 - 2 = .5; A0 = (0 + .5*2 - 1) + .25*.5 = .125
    # row 1 (lam 1, bootstrap 0):  A1 = 1 - 2 = -1;        A0 = 0 + .5*(-1) = -.5
    adv, ret = compute_gae(
        rewards, values, torch.ones(2, 2), gamma=0.5, lam=torch.tensor([0.5, 1.0]), bootstrap=torch.tensor([3.0, 0.0])
    )
    torch.testing.assert_close(adv, _t([[0.125, 0.5], [-0.5, -1.0]]))
    torch.testing.assert_close(ret, adv + values)


def test_gae_limits_against_reference():
    # independent references: lam = 1 -> discounted Monte-Carlo return minus V; lam = 0 -> one-step TD error
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = torch.ones(3, 6)
    mask[1, 4:] = 0  # right padding
    mask[2, :2] = 0  # left padding
    gamma = 0.9
    adv1, _ = compute_gae(rewards, values, mask, gamma=gamma, lam=1.0)
    adv0, _ = compute_gae(rewards, values, mask, gamma=gamma, lam=0.0)
    for b in range(3):
        idx = [t for t in range(6) if mask[b, t] > 0]
        for k, t in enumerate(idx):
            mc = sum(gamma**j * rewards[b, idx[k + j]].item() for j in range(len(idx) - k))
            assert adv1[b, t].item() == pytest.approx(mc - values[b, t].item(), abs=1e-5)
            next_v = values[b, idx[k + 1]].item() if k + 1 < len(idx) else 0.0
            td = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            assert adv0[b, t].item() == pytest.approx(td, abs=1e-5)
        for t in range(6):
            if mask[b, t] == 0:
                assert adv1[b, t].item() == 0.0


def test_gae_shape_errors():
    with pytest.raises(ValueError, match="\\[B, T\\]"):
        compute_gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="lam"):
        compute_gae(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), lam=torch.ones(3))


def test_turn_gae_hand_values():
    turn_ids = torch.tensor([[-1, 0, 0, -1, 1, 1]])
    rewards = _t([[9, 1, 2, 9, 0, 3]])  # -1 positions are ignored
    values = _t([[9, 0.5, 7, 9, 1.0, 5]])  # V_u = value at the turn's first token
    # R0 = 3, V0 = .5; R1 = 3, V1 = 1. gamma 1, lam .5: A1 = 3 - 1 = 2; A0 = (3 + 1 - .5) + .5 * 2 = 4.5
    adv, ret = compute_turn_gae(rewards, values, turn_ids, gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, _t([[0, 4.5, 4.5, 0, 2, 2]]))
    torch.testing.assert_close(ret, _t([[0, 5, 5, 0, 3, 3]]))
    kl = _t([[0.7, -0.1, -0.2, 0.7, -0.3, 0.0]])  # token KL stays out of the recursion, added back per token
    adv_kl, ret_kl = compute_turn_gae(rewards, values, turn_ids, gamma=1.0, lam=0.5, token_rewards=kl)
    torch.testing.assert_close(adv_kl, _t([[0, 4.4, 4.3, 0, 1.7, 2]]))
    torch.testing.assert_close(ret_kl, ret)


def test_turn_gae_single_token_turns_equal_token_gae():
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    turn_ids = torch.tensor([[0, 1, 2, 3, 4], [-1, 0, 1, 2, -1]])
    adv_t, ret_t = compute_turn_gae(rewards, values, turn_ids, gamma=0.9, lam=0.8)
    adv, ret = compute_gae(rewards, values, (turn_ids >= 0).float(), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv_t, adv)
    torch.testing.assert_close(ret_t, ret)


def test_turn_gae_rejects_decreasing_ids():
    with pytest.raises(ValueError, match="non-decreasing"):
        compute_turn_gae(torch.zeros(1, 3), torch.zeros(1, 3), torch.tensor([[1, -1, 0]]))


def test_lambda_schedules():
    torch.testing.assert_close(vapo_lambda(torch.tensor([0, 10, 40, 100]), alpha=0.05), _t([0.0, 0.0, 0.5, 0.8]))
    torch.testing.assert_close(
        relative_position_lambda(torch.tensor([0, 1, 2, 3]), q=0.5), _t([0.0, 1.0, 0.5, 0.5**0.5])
    )


def test_turn_gae_discount_bootstrap_and_absent_turn():
    # turns 0 and 2 (turn 1 absent: no step); R0 = 2, V0 = 1; R2 = 2, V2 = 2; gamma .5, lam .5, bootstrap 4
    # A2 = 2 + .5 * 4 - 2 = 2; A0 = (2 + .5 * 2 - 1) + .25 * 2 = 2.5
    turn_ids = torch.tensor([[0, 0, 2, 2, -1]])
    adv, ret = compute_turn_gae(
        _t([[1, 1, 0, 2, 9]]), _t([[1, 5, 2, 7, 9]]), turn_ids, gamma=0.5, lam=0.5, bootstrap=torch.tensor([4.0])
    )
    torch.testing.assert_close(adv, _t([[2.5, 2.5, 2, 2, 0]]))
    torch.testing.assert_close(ret, _t([[3.5, 3.5, 4, 4, 0]]))


def test_count_turns():
    turns = torch.tensor([[0, 0, -1, 1, 1, 2], [-1, 0, -1, 0, -1, -1], [-1, -1, -1, -1, -1, -1]])
    assert count_turns(turns).tolist() == [3, 1, 0]
