import math

import pytest
import torch

from trl_stable.core import (
    decoupled_ppo_loss,
    decoupled_ppo_term,
    fold_behaviour_weight,
    ppo_clip_term,
    pre_mask_token_mean,
)


def test_ppo_clip_term_hand_values():
    # ratios 1.5, 0.5, 1.1 ; advantages +1, -1, -2 ; eps 0.2
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))
    prox = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, -2.0]])
    out = ppo_clip_term(logps, prox, adv)
    # +A, r=1.5: max(-1.5, -1.2) = -1.2 ; -A, r=.5: max(.5, .8) = .8 ; -2, r=1.1: max(2.2, 2.2) = 2.2
    torch.testing.assert_close(out, torch.tensor([[-1.2, 0.8, 2.2]]))
    # clip-higher: eps_high 0.6 lets r=1.5 through
    torch.testing.assert_close(ppo_clip_term(logps, prox, adv, eps_high=0.6)[0, 0], torch.tensor(-1.5))


def test_dual_clip_bounds_negative_advantages():
    logps = torch.log(torch.tensor([[10.0, 10.0]]))
    adv = torch.tensor([[-1.0, 1.0]])
    out = ppo_clip_term(logps, torch.zeros(1, 2), adv, dual_clip=3.0)
    torch.testing.assert_close(out, torch.tensor([[3.0, -1.2]]))
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_term(logps, torch.zeros(1, 2), adv, dual_clip=1.0)


def test_pre_mask_token_mean_counts_filtered_tokens():
    loss = torch.tensor([[1.0, 2.0, float("inf")], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    keep = torch.tensor([[True, True, False], [False, True, True]])
    # kept & masked: 1 + 2 + 5 = 8 ; pre-mask count 5
    torch.testing.assert_close(pre_mask_token_mean(loss, mask, keep), torch.tensor(8.0 / 5))
    torch.testing.assert_close(pre_mask_token_mean(loss[1:], mask[1:]), torch.tensor(4.5))


def test_decoupled_term_and_loss_hand_value():
    logps = torch.log(torch.tensor([[1.5, 1.0]]))
    prox = torch.zeros(1, 2)
    w = torch.tensor([[2.0, 0.5]])
    adv = torch.tensor([[1.0, 1.0]])
    term = decoupled_ppo_term(logps, prox, w, adv)
    torch.testing.assert_close(term, torch.tensor([[-2.4, -0.5]]))
    loss = decoupled_ppo_loss(logps, prox, w, adv, torch.ones(1, 2), keep=torch.tensor([[False, True]]))
    torch.testing.assert_close(loss, torch.tensor(-0.25))


def test_fold_behaviour_weight_equals_decoupled_term_with_gradient():
    torch.manual_seed(0)
    logps = (torch.randn(3, 5) * 0.3).requires_grad_()
    prox = torch.randn(3, 5) * 0.3
    w = torch.rand(3, 5) * 3
    adv = torch.randn(3)
    keep = torch.rand(3, 5) > 0.3
    mask = torch.ones(3, 5)
    for dual in (None, 3.0):
        ref = decoupled_ppo_loss(logps, prox, w, adv.unsqueeze(1).expand(3, 5), mask, keep, 0.2, 0.28, dual)
        (g_ref,) = torch.autograd.grad(ref, logps)
        folded = fold_behaviour_weight(adv, w, keep)
        ours = pre_mask_token_mean(ppo_clip_term(logps, prox, folded, 0.2, 0.28, dual), mask)
        (g_ours,) = torch.autograd.grad(ours, logps)
        torch.testing.assert_close(ours, ref)
        torch.testing.assert_close(g_ours, g_ref)
    assert math.isfinite(ours.item())


def test_ppo_clip_term_clamps_the_log_ratio_before_the_exp():
    from trl_stable.core.policy_loss import LOG_RATIO_BOUND

    logps = torch.tensor([[0.0, 100.0, -100.0, 0.5]], requires_grad=True)
    prox = torch.zeros(1, 4)
    advantages = torch.tensor([[1.0, -1.0, -1.0, -1.0]])
    loss = ppo_clip_term(logps, prox, advantages)
    assert torch.isfinite(loss).all()
    # beyond the bound the unclipped branch saturates at -A * e^20 (unclamped it would be inf)
    assert loss[0, 1].item() == pytest.approx(math.exp(LOG_RATIO_BOUND), rel=1e-6)
    # inside the bound nothing changes: -A * max(r, clip(r)) with r = e^0.5 > 1.2
    assert loss[0, 3].item() == pytest.approx(math.exp(0.5), rel=1e-6)
    loss.sum().backward()
    assert logps.grad[0, 1].item() == 0.0 and logps.grad[0, 3].item() == pytest.approx(math.exp(0.5), rel=1e-6)
