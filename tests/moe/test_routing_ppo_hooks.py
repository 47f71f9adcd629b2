"""Routing replay inside trl_stable's PPOTrainer: the `RoutingHook` points of its step (R2 and R3)."""

from __future__ import annotations

import pytest
import torch
from tiny_configs import tiny_ppo_args

from trl_stable.moe.hook import ROUTED_EXPERTS_KEY
from trl_stable.testing import build_causal_lm
from trl_stable.trainers.ppo import PPOTrainer


def _trainer(tmp_path, tokenizer, mode, learning_rate):
    args = tiny_ppo_args(tmp_path, routing_replay=mode, ppo_epochs=2, learning_rate=learning_rate, seed=0)
    return PPOTrainer(build_causal_lm("qwen2_moe", tokenizer, seed=0), args=args, processing_class=tokenizer)


def _queries(tokenizer):
    texts = ["The movie was", "I think that the", "A story", "We saw"]
    return [torch.tensor(tokenizer(t)["input_ids"]) for t in texts]


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_ppo_routing_replay_logs_agreement(tmp_path, tokenizer, mode):
    # learning rate 0: every update pass runs on the rollout weights, so a correctly aligned replay agrees everywhere
    trainer = _trainer(tmp_path / "frozen", tokenizer, mode, learning_rate=0.0)
    queries = _queries(tokenizer)
    responses = trainer.generate(queries, return_prompt=False)
    stats = trainer.step(queries, responses, [[0.0] * (len(r) - 1) + [1.0] for r in responses])
    assert stats["routing/agreement"] == 1.0
    assert "routing/agreement/layer_1" in stats
    assert 0.0 < stats["routing/replayed_frac"] <= 1.0
    assert stats["policy/approxkl"] == 0.0
    if mode == "R3":
        assert stats["routing/rollout_agreement"] == 1.0  # generate's routing == the trainer's on the same weights
    logged = [entry for entry in trainer.state.log_history if "routing/agreement" in entry]
    assert logged, trainer.state.log_history

    # a real step: the routers move, replay keeps the experts, agreement reports the drift
    trainer = _trainer(tmp_path / "train", tokenizer, mode, learning_rate=5e-2)
    router = trainer.unwrapped().policy.model.layers[0].mlp.gate.weight
    before = router.detach().clone()
    for _ in range(2):
        responses = trainer.generate(queries, return_prompt=False)
        stats = trainer.step(queries, responses, [[0.0] * (len(r) - 1) + [1.0] for r in responses])
        assert 0.0 <= stats["routing/agreement"] <= 1.0
    assert not torch.equal(before, router.detach())


def test_ppo_r3_refuses_responses_it_did_not_generate(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, "R3", learning_rate=0.0)
    queries = _queries(tokenizer)
    responses = trainer.generate(queries, return_prompt=False)
    edited = [torch.cat([r[:-1], torch.tensor([5])]) if len(r) > 1 else torch.tensor([5, 5]) for r in responses]
    with pytest.raises(ValueError, match="needs the sampler's routing"):
        trainer.step(queries, edited, [[0.0] * len(r) for r in edited])  # a plain list carries no routing
    longer = [torch.cat([q, q]) for q in queries]
    with pytest.raises(ValueError, match="not the one generate"):
        trainer.step(longer, responses, [[0.0] * len(r) for r in responses])
    # the Rollout carries its routing: stepping it (again) needs no bookkeeping in the trainer
    stats = trainer.step(queries, responses, [[0.0] * len(r) for r in responses])
    assert stats["routing/agreement"] == 1.0


def test_ppo_r2_puts_routing_in_the_rollout_batch(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, "R2", learning_rate=0.0)
    queries = _queries(tokenizer)
    responses = trainer.generate(queries, return_prompt=False)
    batch = trainer.make_batch(queries, responses)
    result, _ = trainer.rollout_pass(batch)
    routing = result[ROUTED_EXPERTS_KEY]
    assert routing.shape == (*batch["input_ids"].shape, 2, 2)
    assert torch.equal((routing >= 0).all(-1).all(-1), batch["attention_mask"].bool())


def test_ppo_off_and_r2_agree_on_frozen_weights(tmp_path, tokenizer):
    """At learning rate 0 replaying the rollout pass's own routing changes no forward: the same losses as "off"."""
    stats = []
    for mode in ("off", "R2"):
        torch.manual_seed(0)
        trainer = _trainer(tmp_path / mode, tokenizer, mode, learning_rate=0.0)
        queries = _queries(tokenizer)
        responses = trainer.generate(queries, return_prompt=False)
        stats.append(trainer.step(queries, responses, [[0.0] * (len(r) - 1) + [1.0] for r in responses]))
    for key in ("loss/total", "policy/approxkl", "objective/kl"):
        assert stats[0][key] == pytest.approx(stats[1][key], abs=1e-6)
    assert not any(key.startswith("routing/") for key in stats[0])
    assert stats[1]["routing/agreement"] == 1.0


def test_ppo_train_with_r3_logs_agreement(tmp_path, tokenizer):
    from datasets import Dataset

    args = tiny_ppo_args(
        tmp_path, routing_replay="R3", ppo_epochs=2, max_steps=2, logging_steps=1, learning_rate=1e-2, seed=0
    )
    dataset = Dataset.from_dict({"prompt": ["The movie was", "I think that the", "A story", "We saw"]})
    trainer = PPOTrainer(
        build_causal_lm("olmoe", tokenizer, seed=0), reward_funcs=lambda completions, **kw: [1.0] * len(completions),
        args=args, train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "routing/agreement" in entry]
    assert len(logged) == 2
    assert all("routing/rollout_agreement" in entry and "routing/replayed_frac" in entry for entry in logged)
