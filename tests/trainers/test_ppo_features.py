"""PPOTrainer options: turn-level GAE, lambda schedules, bootstrap, early stop, ratio threshold, decoupled loss."""

import pytest
import torch
from tiny_configs import tiny_ppo_args

import trl_stable.core.estimators as estimators_mod
from trl_stable import PPOConfig, PPOTrainer
from trl_stable.testing import build_causal_lm


def _args(tmp_path, **kw):
    return tiny_ppo_args(tmp_path, **{"learning_rate": 1e-3, **kw})


QUERIES = [torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([8, 9, 10]), torch.tensor([11])]
RESPONSES = [torch.tensor([20, 21, 22, 23]), torch.tensor([24, 25]), torch.tensor([26, 27, 28]), torch.tensor([29])]


def _trainer(tmp_path, tokenizer, **kw):
    return PPOTrainer(
        build_causal_lm("qwen2", tokenizer, seed=0), args=_args(tmp_path, **kw), processing_class=tokenizer
    )


def test_turn_ids_use_turn_gae(tmp_path, tokenizer, monkeypatch):
    trainer = _trainer(tmp_path, tokenizer, init_kl_coef=0.5, adap_kl_ctrl=False)
    seen = {}
    real = estimators_mod.compute_turn_gae

    def spy(rewards, values, turn_ids, gamma, lam, token_rewards=None, bootstrap=None):
        seen.update(rewards=rewards.clone(), turn_ids=turn_ids.clone(), token_rewards=token_rewards.clone())
        return real(rewards, values, turn_ids, gamma, lam, token_rewards=token_rewards, bootstrap=bootstrap)

    monkeypatch.setattr(estimators_mod, "compute_turn_gae", spy)
    turn_ids = [[0, 0, -1, 1], [0, 0], [0, -1, -1], [0]]  # -1: tool output inside the response
    dense = [[1.0, 0.0, 9.0, 0.0], [0.0, 0.0], [2.0, 9.0, 9.0], [0.0]]
    stats = trainer.step(QUERIES, RESPONSES, dense, scores=[10.0, 20.0, 30.0, 40.0], turn_ids=turn_ids)
    # the score lands on the last assistant token; tool tokens carry nothing
    expected = torch.tensor([[1.0, 0, 0, 10], [0, 20, 0, 0], [32.0, 0, 0, 0], [40.0, 0, 0, 0]])
    torch.testing.assert_close(seen["rewards"], expected)
    assert seen["turn_ids"][0].tolist() == [0, 0, -1, 1] and seen["turn_ids"][2].tolist() == [0, -1, -1, -1]
    assert (seen["token_rewards"][0, 2] == 0).item()  # no KL term on a tool token
    assert stats["tokens/response_len_mean"] == pytest.approx(2.5)


def test_lambda_schedules_and_lam_fn(tmp_path, tokenizer, monkeypatch):
    lams = []
    real = estimators_mod.compute_gae

    def spy(rewards, values, mask, gamma, lam, bootstrap):
        lams.append(lam)
        return real(rewards, values, mask, gamma, lam, bootstrap)

    monkeypatch.setattr(estimators_mod, "compute_gae", spy)
    _trainer(tmp_path, tokenizer, lam_schedule="vapo", lam_alpha=0.5).step(QUERIES, RESPONSES, scores=[1.0] * 4)
    torch.testing.assert_close(lams[-1], torch.tensor([0.5, 0.0, 1 - 1 / 1.5, 0.0]))
    _trainer(tmp_path, tokenizer, lam_schedule="relative_position", lam_q=0.25).step(
        QUERIES, RESPONSES, scores=[1.0] * 4
    )
    torch.testing.assert_close(lams[-1], torch.tensor([0.25 ** (1 / 3), 0.25, 0.5, 1.0]))
    custom = PPOTrainer(
        build_causal_lm("qwen2", tokenizer, seed=0),
        args=_args(tmp_path),
        processing_class=tokenizer,
        lam_fn=lambda lengths: 1.0 / lengths.float(),
    )
    custom.step(QUERIES, RESPONSES, scores=[1.0] * 4)
    torch.testing.assert_close(lams[-1], torch.tensor([0.25, 0.5, 1 / 3, 1.0]))


def test_bootstrap_truncated(tmp_path, tokenizer, monkeypatch):
    seen = {}
    real = estimators_mod.compute_gae

    def spy(rewards, values, mask, gamma, lam, bootstrap):
        seen["bootstrap"] = bootstrap
        return real(rewards, values, mask, gamma, lam, bootstrap)

    monkeypatch.setattr(estimators_mod, "compute_gae", spy)
    trainer = _trainer(tmp_path, tokenizer, bootstrap_truncated=True)
    eos = tokenizer.eos_token_id
    responses = [torch.tensor([20, eos]), torch.tensor([24, 25]), torch.tensor([26, eos]), torch.tensor([29])]
    trainer.step(QUERIES, responses, scores=[1.0] * 4)
    boot = seen["bootstrap"]
    assert boot[0] == 0 and boot[2] == 0 and boot[1] != 0 and boot[3] != 0


def test_early_stop_and_ratio_threshold(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, ppo_epochs=4, target_kl=1e-9, learning_rate=1e-2)
    stats = trainer.step(QUERIES, RESPONSES, scores=[1.0, -1.0, 0.5, 0.0])
    # the first mini-batch sees ratio 1 (KL 0) and steps; a later one exceeds 1.5 x target_kl and stops the epochs
    assert stats["ppo/early_stop"] == 1.0 and stats["ppo/epochs_done"] < 4
    zeroed = _trainer(tmp_path, tokenizer)
    # below the mean ratio 1 every step starts at, so every loss is zeroed (PPOConfig refuses it: set past the check)
    zeroed.args.ratio_threshold = 0.5
    before = {n: p.detach().clone() for n, p in zeroed.unwrapped().named_parameters()}
    stats = zeroed.step(QUERIES, RESPONSES, scores=[1.0, -1.0, 0.5, 0.0])
    assert stats["ppo/loss_zeroed"] == 1.0
    assert all(torch.equal(p, before[n]) for n, p in zeroed.unwrapped().named_parameters())


def test_decoupled_loss_with_generate_and_icepop(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, use_decoupled_loss=True, token_filter="icepop")
    responses = trainer.generate(QUERIES, return_prompt=False)
    stats = trainer.step(QUERIES, responses, scores=[1.0, -1.0, 0.5, 0.0])
    # the same weights sample and score: w ~ 1, nothing filtered
    assert stats["behaviour_weight/mean"] == pytest.approx(1.0, abs=1e-3)
    assert stats["token_filter/icepop/masked_token_frac"] == 0.0
    with pytest.raises(ValueError, match="sampler's log-probs"):
        trainer.step(QUERIES, [r.clone() for r in responses], scores=[1.0] * 4)


def test_decoupled_loss_masks_mismatched_tokens(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, use_decoupled_loss=True, token_filter="kpop", mini_batch_size=4)
    batch, _ = trainer.rollout_pass(trainer.make_batch(QUERIES, RESPONSES))
    sampler = [batch["old_logprobs"][i, : len(r)].clone() for i, r in enumerate(RESPONSES)]
    sampler[0][1] = 0.0  # the sampler claims probability 1 for a token the trainer finds unlikely
    stats = trainer.step(QUERIES, RESPONSES, scores=[1.0, -1.0, 0.5, 0.0], sampler_logprobs=sampler)
    assert stats["token_filter/kpop/masked_token_frac"] == pytest.approx(1 / 10)
    with pytest.raises(ValueError, match="use_decoupled_loss"):
        PPOConfig(output_dir=str(tmp_path), token_filter="icepop")
    with pytest.raises(ValueError, match="KPop only masks"):
        PPOConfig(output_dir=str(tmp_path), use_decoupled_loss=True, token_filter="kpop", token_filter_action="clamp")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"token_filter_level": "sequence"}, "token_filter_level only apply"),
        ({"use_decoupled_loss": True, "token_filter": "kpop", "token_filter_lower": 0.1}, "token_filter_lower"),
        ({"use_decoupled_loss": True, "token_filter": "icepop", "token_filter_lower": 6.0}, "token_filter_lower"),
        ({"step_mask_tools": ["search"]}, "step_loss_mask=True"),
    ],
)
def test_ppo_config_shares_the_grpo_filter_and_step_mask_checks(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(output_dir=str(tmp_path), **kwargs)
    bounds = PPOConfig(output_dir=str(tmp_path), use_decoupled_loss=True, token_filter="kpop").filter_bounds
    assert bounds == (None, 2.0)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3"])
def test_every_kit_family_steps(tmp_path, tokenizer, family):
    model = build_causal_lm(family, tokenizer, seed=0)
    trainer = PPOTrainer(
        model, args=_args(tmp_path, batch_size=2, mini_batch_size=2, max_new_tokens=3), processing_class=tokenizer
    )
    queries = QUERIES[:2]
    stats = trainer.step(queries, trainer.generate(queries, return_prompt=False), scores=[1.0, 0.0])
    assert stats["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # reference == initial policy
    assert stats["val/ratio"] == pytest.approx(1.0, abs=1e-3)  # mixtral's router jitter moves it a little


def test_turn_gae_lambda_from_turn_count_and_whitened_rewards(tmp_path, tokenizer, monkeypatch):
    """Turn mode: the lambda schedule sees the number of turns (the steps its recursion runs over, as AReaL counts
    them; not the action tokens), and whiten_rewards whitens the whole reward
    (score + dense - kl_coef KL) exactly as token mode does, even though the KL share stays out of the recursion."""
    seen = {}
    real_gae, real_turn = estimators_mod.compute_gae, estimators_mod.compute_turn_gae

    def spy_gae(rewards, values, mask, gamma, lam, bootstrap):
        seen["token"] = rewards.clone()
        return real_gae(rewards, values, mask, gamma, lam, bootstrap)

    def spy_turn(rewards, values, turn_ids, gamma, lam, token_rewards=None, bootstrap=None):
        seen["turn"] = rewards + token_rewards
        seen["lam"] = lam
        return real_turn(rewards, values, turn_ids, gamma, lam, token_rewards=token_rewards, bootstrap=bootstrap)

    monkeypatch.setattr(estimators_mod, "compute_gae", spy_gae)
    monkeypatch.setattr(estimators_mod, "compute_turn_gae", spy_turn)
    kw = dict(whiten_rewards=True, init_kl_coef=0.5, adap_kl_ctrl=False, lam_schedule="relative_position", lam_q=0.5)
    dense = [[1.0, 0.0, 0.5, 0.0], [0.0, 2.0], [1.0, 0.0, 0.0], [3.0]]
    scores = [1.0, -1.0, 0.5, 0.0]
    _trainer(tmp_path, tokenizer, **kw).step(QUERIES, RESPONSES, dense, scores=scores)
    one_turn = [[0] * len(r) for r in RESPONSES]
    _trainer(tmp_path, tokenizer, **kw).step(QUERIES, RESPONSES, dense, scores=scores, turn_ids=one_turn)
    torch.testing.assert_close(seen["turn"], seen["token"])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]).bool()
    assert seen["token"][mask].std().item() == pytest.approx(1.0, abs=1e-4)  # whitened; the mean is kept
    assert (seen["token"][~mask] == 0).all()

    # 2, 2, 2 and 1 action tokens in 2, 1, 1 and 1 turns: relative-position lambda q^(1/(L-1)) = 0.5 for L = 2 turns,
    # 1 for a single turn (counting action tokens instead would give 0.5, 0.5, 0.5, 1)
    with_tools = [[0, -1, -1, 1], [0, 0], [0, 0, -1], [0]]
    _trainer(tmp_path, tokenizer, **kw).step(QUERIES, RESPONSES, dense, scores=scores, turn_ids=with_tools)
    torch.testing.assert_close(seen["lam"], torch.tensor([0.5, 1.0, 1.0, 1.0]))


def test_start_up_line_names_the_active_paths(tmp_path, tokenizer, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="trl_stable.trainers.ppo.ppo_trainer"):
        trainer = _trainer(
            tmp_path, tokenizer, use_decoupled_loss=True, token_filter="icepop", kl_penalty="k3", lam_schedule="vapo"
        )
    line = trainer.describe()
    assert line in caplog.text
    assert "advantages=gae (vapo" in line and "kl=k3, adaptive" in line
    assert "loss=decoupled, filter=icepop[0.5, 5.0] token/mask" in line and "routing=off" in line
