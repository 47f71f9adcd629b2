"""Routing replay wired into trl_stable's own GRPOTrainer / PPOTrainer through the `routing_replay` config field."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from tiny_configs import tiny_grpo_args, tiny_ppo_args

from trl_stable import GRPOConfig, GRPOTrainer
from trl_stable.moe.hook import ROUTED_EXPERTS_KEY
from trl_stable.testing import build_causal_lm


class _Spy(GRPOTrainer):
    def _compute_loss(self, model, inputs):
        self.seen = getattr(self, "seen", []) + [inputs.get(ROUTED_EXPERTS_KEY)]
        return super()._compute_loss(model, inputs)


def _grpo(tmp_path, tokenizer, reward, **config):
    args = tiny_grpo_args(tmp_path, max_completion_length=5, seed=0, **config)
    dataset = Dataset.from_dict({"prompt": ["the cat sat", "hello there my friend", "a quiet day", "one"]})
    trainer = _Spy(
        model=build_causal_lm("qwen3_moe", tokenizer), reward_funcs=reward, args=args, train_dataset=dataset,
        processing_class=tokenizer,
    )  # fmt: skip
    trainer.train()
    return trainer


def test_config_field_validates():
    with pytest.raises(ValueError, match="routing_replay must be one of"):
        GRPOConfig(output_dir="unused", use_cpu=True, routing_replay="R4")


def test_grpo_r2_records_in_the_proximal_pass_of_the_decoupled_loss(tmp_path, tokenizer):
    """num_iterations=1: TRL skips its old-logprob pass, trl_stable's decoupled loss runs a proximal pass instead;
    R2 records there and the update replays it."""
    trainer = _grpo(
        tmp_path, tokenizer, lambda completions, **kw: [float(len(c)) for c in completions],
        routing_replay="R2", use_decoupled_loss=True,
    )  # fmt: skip
    log = trainer.state.log_history[0]
    assert log["routing/agreement"] == 1.0  # one update on the proximal pass's weights
    assert 0.0 < log["routing/replayed_frac"] <= 1.0
    assert trainer.seen[0] is not None and trainer.seen[0].shape[2:] == (2, 2)


def test_grpo_r3_with_dynamic_sampling_refills(tmp_path, tokenizer):
    """Refill rounds concatenate batches of different widths: the routing is re-padded with the ids."""
    calls = []

    def reward(completions, **kw):  # the first round has no signal, so dynamic sampling drops it and refills
        calls.append(1)
        return [0.0] * len(completions) if len(calls) == 1 else [float(len(c)) for c in completions]

    trainer = _grpo(
        tmp_path, tokenizer, reward, routing_replay="R3", dynamic_sampling=True, dynamic_sampling_max_refills=1,
    )  # fmt: skip
    assert len(calls) == 2
    log = trainer.state.log_history[0]
    assert log["routing/agreement"] == 1.0  # the update runs on the sampler's weights
    routing = trainer.seen[0]
    assert routing is not None and routing.shape[2:] == (2, 2)


def test_ppo_config_field(tmp_path, tokenizer):
    from trl_stable import PPOConfig, PPOTrainer

    with pytest.raises(ValueError, match="routing_replay must be one of"):
        PPOConfig(output_dir=str(tmp_path), routing_replay="on")
    args = tiny_ppo_args(tmp_path, routing_replay="R2", ppo_epochs=2, max_new_tokens=4)
    trainer = PPOTrainer(build_causal_lm("deepseek_v3", tokenizer), args=args, processing_class=tokenizer)
    queries = [torch.tensor(tokenizer(t)["input_ids"]) for t in ["The movie was", "I think", "A story", "We saw"]]
    responses = trainer.generate(queries, return_prompt=False)
    stats = trainer.step(queries, responses, [[0.0] * (len(r) - 1) + [1.0] for r in responses])
    assert 0.0 <= stats["routing/agreement"] <= 1.0 and "routing/replayed_frac" in stats
