"""Routing replay inside trl_stable's PPOTrainer through PPORoutingReplayMixin (R2 and R3)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from trl_stable.moe.trainer_hooks import (
    ROUTED_EXPERTS_KEY,
    ROUTING_REPLAY_HELP,
    PPORoutingReplayMixin,
    check_routing_replay_mode,
    with_routing_replay,
)
from trl_stable.testing import build_causal_lm
from trl_stable.trainers.ppo import PPOTrainer
from trl_stable.trainers.ppo_config import PPOConfig

_BASE_HAS_FIELD = "routing_replay" in PPOConfig.__dataclass_fields__


@dataclass
class _Config(PPOConfig):
    if not _BASE_HAS_FIELD:  # until PPOConfig carries the field itself
        routing_replay: str = field(default="off", metadata={"help": ROUTING_REPLAY_HELP})

        def __post_init__(self):
            super().__post_init__()
            check_routing_replay_mode(self.routing_replay)


_Trainer = PPOTrainer if issubclass(PPOTrainer, PPORoutingReplayMixin) else with_routing_replay(PPOTrainer)


def _trainer(tmp_path, tokenizer, mode, learning_rate):
    args = _Config(
        output_dir=str(tmp_path),
        routing_replay=mode,
        batch_size=4,
        mini_batch_size=2,
        ppo_epochs=2,
        max_new_tokens=5,
        learning_rate=learning_rate,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        seed=0,
    )
    return _Trainer(build_causal_lm("qwen2_moe", tokenizer, seed=0), args=args, processing_class=tokenizer)


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
    router = trainer._unwrapped().policy.model.layers[0].mlp.gate.weight
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
    with pytest.raises(ValueError, match="not the one generate"):
        trainer.step(queries, edited, [[0.0] * len(r) for r in edited])
    with pytest.raises(ValueError, match="last generate"):
        trainer.step(queries, responses, [[0.0] * len(r) for r in responses])  # routing was consumed


def test_ppo_r2_puts_routing_in_the_rollout_batch(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, "R2", learning_rate=0.0)
    queries = _queries(tokenizer)
    responses = trainer.generate(queries, return_prompt=False)
    batch = trainer._build_batch(queries, responses)
    result = trainer._old_logprob_pass(batch)
    routing = result[ROUTED_EXPERTS_KEY]
    assert routing.shape == (*batch["input_ids"].shape, 2, 2)
    assert torch.equal((routing >= 0).all(-1).all(-1), batch["attention_mask"].bool())


def test_ppo_off_is_the_plain_trainer_step_for_step(tmp_path, tokenizer):
    """With routing_replay="off" the mixin changes nothing: same losses as the class without it."""
    stats = []
    base = next(
        c for c in PPOTrainer.__mro__ if c.__name__ == "PPOTrainer" and PPORoutingReplayMixin not in c.__bases__
    )
    for cls in (base, _Trainer):
        torch.manual_seed(0)
        args = _Config(
            output_dir=str(tmp_path), batch_size=4, mini_batch_size=2, ppo_epochs=2, max_new_tokens=5,
            report_to="none", disable_tqdm=True, save_strategy="no", seed=0,
        )  # fmt: skip
        trainer = cls(build_causal_lm("qwen2_moe", tokenizer, seed=0), args=args, processing_class=tokenizer)
        queries = _queries(tokenizer)
        responses = trainer.generate(queries, return_prompt=False)
        stats.append(trainer.step(queries, responses, [[0.0] * (len(r) - 1) + [1.0] for r in responses]))
    for key in ("loss/total", "policy/approxkl", "objective/kl"):
        assert stats[0][key] == stats[1][key]
    assert not any(key.startswith("routing/") for key in stats[1])


def test_ppo_train_with_r3_logs_agreement(tmp_path, tokenizer):
    from datasets import Dataset

    args = _Config(
        output_dir=str(tmp_path), routing_replay="R3", batch_size=4, mini_batch_size=2, ppo_epochs=2,
        max_new_tokens=5, max_steps=2, logging_steps=1, learning_rate=1e-2, report_to="none", disable_tqdm=True,
        save_strategy="no", seed=0,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": ["The movie was", "I think that the", "A story", "We saw"]})
    trainer = _Trainer(
        build_causal_lm("olmoe", tokenizer, seed=0), reward_funcs=lambda completions, **kw: [1.0] * len(completions),
        args=args, train_dataset=dataset, processing_class=tokenizer,
    )  # fmt: skip
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "routing/agreement" in entry]
    assert len(logged) == 2
    assert all("routing/rollout_agreement" in entry and "routing/replayed_frac" in entry for entry in logged)
