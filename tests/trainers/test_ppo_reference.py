"""PPOTrainer's numbers against an independent reference: unpadded per-sample forwards and plain-Python GAE.

One PPO step with one mini-batch and one epoch makes the first update's ratio exactly 1, so the logged losses have a
closed form: loss/policy = token mean of -A and loss/value = 0.5 token mean of (V - R)^2 with R = A + V, where A is
GAE over r_t = -kl_coef * KL_t + dense_t + [t = last] * score. The reference below recomputes all of it per sample,
without padding, from the models themselves.
"""

import pytest
import torch
import torch.nn.functional as F
from tiny_configs import tiny_ppo_args

from trl_stable import PPOTrainer
from trl_stable.core.masked_stats import masked_whiten
from trl_stable.core.policy_loss import decoupled_ppo_loss, policy_clip_fraction, ppo_clip_term, pre_mask_token_mean
from trl_stable.core.value_loss import clipped_value_loss
from trl_stable.testing import build_causal_lm
from trl_stable.trainers.ppo import RunningMoments


def _reference(trainer, queries, responses, dense, scores, kl_coef, gamma, lam, temperature, kl_penalty, bootstrap):
    policy, ref = trainer.policy, trainer.ref_model
    head = trainer.unwrapped().value_head
    eos = trainer.eos_token_id
    seq_kl, seq_reward, all_adv, all_ret, all_v = [], [], [], [], []
    with torch.no_grad():
        for q, r, d, s in zip(queries, responses, dense, scores):
            ids = torch.cat([q, r]).unsqueeze(0)
            pos = torch.arange(len(q) - 1, len(q) + len(r) - 1)  # the logits that predict the response tokens
            logp_all = F.log_softmax(policy(ids).logits[0, pos] / temperature, -1)
            ref_all = F.log_softmax(ref(ids).logits[0, pos] / temperature, -1)
            hidden = policy.model(ids).last_hidden_state[0]
            values = [head(hidden[p]).item() for p in pos.tolist()]
            after_last = head(hidden[len(q) + len(r) - 1]).item()
            diff = [(logp_all[t, r[t]] - ref_all[t, r[t]]).item() for t in range(len(r))]
            if kl_penalty == "kl":
                kl = diff
            elif kl_penalty == "abs":
                kl = [abs(x) for x in diff]
            elif kl_penalty == "mse":
                kl = [0.5 * x * x for x in diff]
            else:
                kl = [(logp_all[t].exp() * (logp_all[t] - ref_all[t])).sum().item() for t in range(len(r))]
            rewards = [-kl_coef * k + x for k, x in zip(kl, d)]
            rewards[-1] += s
            next_v = after_last if (bootstrap and r[-1].item() != eos) else 0.0
            adv, advs = 0.0, []
            for t in reversed(range(len(r))):
                delta = rewards[t] + gamma * next_v - values[t]
                adv = delta + gamma * lam * adv
                advs.insert(0, adv)
                next_v = values[t]
            seq_kl.append(sum(kl))
            seq_reward.append(sum(rewards))
            all_adv += advs
            all_ret += [a + v for a, v in zip(advs, values)]
            all_v += values
    n_tokens = len(all_adv)
    return {
        "objective/kl": sum(seq_kl) / len(seq_kl),
        "objective/rlhf_reward": sum(seq_reward) / len(seq_reward),
        "objective/non_score_reward": -kl_coef * sum(seq_kl) / len(seq_kl),
        "loss/policy": sum(-a for a in all_adv) / n_tokens,
        "loss/value": 0.5 * sum((v - ret) ** 2 for v, ret in zip(all_v, all_ret)) / n_tokens,
    }


@pytest.mark.parametrize(
    "kl_penalty, temperature, bootstrap",
    [("kl", 1.0, False), ("abs", 0.7, True), ("mse", 1.0, True), ("full", 0.7, False)],
)
def test_step_matches_independent_reference(tmp_path, tokenizer, kl_penalty, temperature, bootstrap):
    args = tiny_ppo_args(
        tmp_path,
        batch_size=3,
        mini_batch_size=3,
        kl_penalty=kl_penalty,
        temperature=temperature,
        init_kl_coef=0.3,
        target=1.0,
        horizon=30.0,
        gamma=0.9,
        lam=0.8,
        whiten_advantages=False,
        bootstrap_truncated=bootstrap,
    )
    trainer = PPOTrainer(
        build_causal_lm("qwen2", tokenizer, seed=0),
        args=args,
        processing_class=tokenizer,
        ref_model=build_causal_lm("qwen2", tokenizer, seed=1),  # a different reference: KL != 0
    )
    eos = tokenizer.eos_token_id
    # unequal prompt and response lengths (left and right padding in the trainer); one response ends with EOS
    queries = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])]
    responses = [torch.tensor([20, 21, 22, 23]), torch.tensor([24, eos]), torch.tensor([26, 27, 28])]
    dense = [[0.5, 0.0, -1.0, 0.25], [1.0, 0.0], [0.0, 2.0, 0.0]]
    scores = [1.0, -2.0, 0.5]
    expected = _reference(
        trainer, queries, responses, dense, scores, 0.3, 0.9, 0.8, temperature, kl_penalty, bootstrap
    )
    stats = trainer.step(queries, responses, dense, scores=scores)
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    assert stats["val/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert stats["loss/total"] == pytest.approx(expected["loss/policy"] + 0.1 * expected["loss/value"], rel=1e-4)
    assert stats["objective/scores"] == pytest.approx(sum(scores) / 3)  # no scaling configured
    assert stats["env/reward_mean"] == pytest.approx(sum(scores) / 3)
    assert stats["dense/reward_mean"] == pytest.approx(sum(map(sum, dense)) / 3)
    # Ziegler's controller, fed the batch's mean sequence KL and n_steps = batch_size (one process)
    error = min(max(expected["objective/kl"] / 1.0 - 1.0, -0.2), 0.2)
    assert trainer.kl_ctl.value == pytest.approx(0.3 * (1 + error * 3 / 30.0), rel=1e-5)


def test_clipped_losses_hand_values():
    # ratios e^0.5 = 1.65 (A > 0: clipped at 1.2), e^-0.5 = 0.61 (A < 0: clipped at 0.8), 1 (A > 0, not clipped)
    logp = torch.tensor([[0.5, -0.5, 0.0, 9.0]])
    old = torch.zeros(1, 4)
    adv = torch.tensor([[2.0, -1.0, 3.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss = pre_mask_token_mean(ppo_clip_term(logp, old, adv, eps_low=0.2), mask)
    clipfrac = policy_clip_fraction(torch.exp(logp - old), adv, mask, clip=0.2)
    # max(-A r, -A clip(r)): -2 * 1.2, 1 * 0.8, -3 * 1 (the 4th token is masked out)
    assert loss.item() == pytest.approx((-2.4 + 0.8 - 3.0) / 3)
    assert clipfrac.item() == pytest.approx(2 / 3)
    # a decoupled weight w scales each token's term; the keep filter drops a token but not from the denominator
    w = torch.tensor([[0.5, 2.0, 1.0, 1.0]])
    keep = torch.tensor([[True, True, False, True]])
    loss_w = decoupled_ppo_loss(logp, old, w, adv, mask, keep, eps_low=0.2)
    assert loss_w.item() == pytest.approx((0.5 * -2.4 + 2.0 * 0.8) / 3)

    values = torch.tensor([[1.0, 0.0, 2.0]])
    old_values = torch.tensor([[0.5, 0.0, 2.5]])
    returns = torch.tensor([[2.0, 1.0, 2.0]])
    vloss, vclip = clipped_value_loss(values, old_values, returns, torch.ones(1, 3), clip=0.2)
    # token 0: V moved +0.5, clipped to 0.7: max((1-2)^2, (0.7-2)^2) = 1.69; token 1: 1; token 2: 2.3 -> 0.09 vs 0
    assert vloss.item() == pytest.approx(0.5 * (1.69 + 1.0 + 0.09) / 3)
    assert vclip.item() == pytest.approx(2 / 3)


def test_masked_whiten_hand_values():
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 6.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    kept = torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3, unbiased std sqrt(14/3)
    white = (kept - 3.0) / (14 / 3 + 1e-8) ** 0.5
    out = masked_whiten(x, mask)
    torch.testing.assert_close(out[mask.bool()], white)
    assert out[0, 2].item() == 0.0 and out[1, 2].item() == 0.0
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False)[mask.bool()], white + 3.0)


def test_running_moments_single_sample_batches():
    rm = RunningMoments()
    rm.update(torch.tensor([5.0]))  # one sample: no spread yet, scores are not blown up by a zero std
    assert rm.mean == pytest.approx(5.0) and rm.std == pytest.approx(1.0)
    rm.update(torch.tensor([7.0]))
    assert rm.mean == pytest.approx(6.0) and rm.std == pytest.approx(2**0.5)
    rm.update(torch.tensor([0.0, 12.0]))
    assert rm.std == pytest.approx(torch.tensor([5.0, 7.0, 0.0, 12.0]).std().item(), rel=1e-6)
