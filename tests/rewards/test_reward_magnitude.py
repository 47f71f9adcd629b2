"""The reward contract's bound on magnitudes (`max_abs_reward`): a huge but finite reward (1e20, 3e38, the edges of
float32 and bfloat16) is treated like a NaN in both trainers, so every number they compute stays finite; the configs
refuse reward weights that could overflow the weighted sum."""

import math

import pytest
import torch
from datasets import Dataset
from tiny_configs import tiny_grpo_args, tiny_ppo_args
from tiny_data import SHORT_PROMPTS

from trl_stable import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
from trl_stable.rewards import dense_reward
from trl_stable.rewards.dense import DEFAULT_MAX_ABS_REWARD, bound_rewards
from trl_stable.testing import build_causal_lm

F32_MAX = float(torch.finfo(torch.float32).max)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
HUGE = [1e20, 1e30, 3e38, -F32_MAX, BF16_MAX, DEFAULT_MAX_ABS_REWARD * (1 + 1e-6)]


def one_huge(value, as_bf16=False):
    """A reward function: completion 0 of each call gets `value`, the others a number in [0, 1) from their tokens."""

    def reward(completion_ids, **kwargs):
        out = [value] + [float(sum(c) % 7) / 7 for c in completion_ids[1:]]
        return torch.tensor(out, dtype=torch.bfloat16) if as_bf16 else out

    reward.__name__ = "one_huge"
    return reward


def _params_finite(model):
    return all(torch.isfinite(p).all() for p in model.parameters())


def _ppo(tmp_path, tokenizer, reward, **overrides):
    args = tiny_ppo_args(tmp_path, **{"max_new_tokens": 4, "max_steps": 2, "learning_rate": 1e-2, **overrides})
    return PPOTrainer(
        build_causal_lm("gpt2", tokenizer, seed=0),
        reward_funcs=reward,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": SHORT_PROMPTS * 2}),
    )


def _grpo(tmp_path, tokenizer, reward, estimator):
    args = tiny_grpo_args(
        tmp_path, num_generations=4, max_completion_length=4, max_steps=2, learning_rate=1e-2,
        advantage_estimator=estimator,
    )  # fmt: skip
    return GRPOTrainer(
        model=build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": SHORT_PROMPTS * 2}),
        processing_class=tokenizer,
    )


@pytest.mark.parametrize("value", HUGE, ids=lambda v: f"{v:.4g}")
@pytest.mark.parametrize("setup", ["ppo", "grpo", "rloo", "dr_grpo"])
def test_a_huge_finite_reward_is_out_of_range_and_training_stays_finite(tmp_path, tokenizer, setup, value, caplog):
    reward = one_huge(value)
    trainer = _ppo(tmp_path, tokenizer, reward) if setup == "ppo" else _grpo(tmp_path, tokenizer, reward, setup)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    model = trainer.policy if setup == "ppo" else trainer.model
    assert _params_finite(model)
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.model.parameters()))  # it trained
    logs = [h for h in trainer.state.log_history if "rewards/one_huge/out_of_range" in h]
    assert logs and all(h["rewards/one_huge/out_of_range"] > 0 for h in logs)
    losses = [h.get("loss/total", h.get("loss")) for h in logs]
    assert all(math.isfinite(x) for x in losses), losses
    assert "beyond max_abs_reward=1e+06" in caplog.text


def test_the_bound_is_inclusive_and_bfloat16_rewards_at_their_edge_are_out_of_range(tmp_path, tokenizer):
    at_bound, _ = bound_rewards(torch.tensor([[DEFAULT_MAX_ABS_REWARD], [-DEFAULT_MAX_ABS_REWARD]]), ["f"])
    assert at_bound.tolist() == [[1e6], [-1e6]]
    bounded, counts = bound_rewards(torch.tensor([[1.0, math.inf], [3e38, -2.0], [math.nan, 1e7]]), ["a", "b"])
    assert counts.tolist() == [1, 2] and bool(torch.isnan(bounded[1, 0])) and bounded[1, 1] == -2.0
    trainer = _ppo(tmp_path, tokenizer, one_huge(BF16_MAX, as_bf16=True), max_steps=1)
    trainer.train()
    assert _params_finite(trainer.policy)
    assert trainer.state.log_history[0]["rewards/one_huge/out_of_range"] == 1.0
    no_bound, counts = bound_rewards(torch.tensor([[1e30], [math.inf]]), ["f"], limit=None)  # only +-inf
    assert no_bound[0, 0] == 1e30 and counts.tolist() == [1]


def test_huge_dense_token_rewards_and_step_scores_are_out_of_range(tmp_path, tokenizer, caplog):
    @dense_reward
    def spiky(completion_ids, **kwargs):
        return [[1e25] + [0.1] * (len(c) - 1) for c in completion_ids]

    trainer = _ppo(tmp_path / "dense", tokenizer, [one_huge(0.5), spiky], max_steps=1)
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss/total" in h]
    assert _params_finite(trainer.policy) and math.isfinite(log["loss/total"])
    assert log["rewards/spiky/nan_tokens"] == 4.0  # one token per completion, used as 0

    stepper = _ppo(tmp_path / "step", tokenizer, None)
    queries = [torch.tensor([5, 6])] * 4
    responses = [torch.tensor([7, 8, 9])] * 4
    with pytest.warns(UserWarning, match="Dropping 1 of 4 samples"):
        stats = stepper.step(queries, responses, scores=[1e20, 1.0, 0.0, 0.5])
    assert stats["ppo/dropped_samples"] == 1.0 and math.isfinite(stats["loss/total"])


def test_weights_that_could_overflow_the_weighted_sum_are_refused(tmp_path):
    for config in (PPOConfig, GRPOConfig):
        with pytest.raises(ValueError, match=r"reward_weights=.*times max_abs_reward=1e\+06 exceeds 1e\+15"):
            config(output_dir=str(tmp_path), reward_weights=[6e8, -6e8], use_cpu=True)
        assert config(output_dir=str(tmp_path), reward_weights=[5e8, -5e8], use_cpu=True).max_abs_reward == 1e6
        # a smaller bound makes room for larger weights
        config(output_dir=str(tmp_path), reward_weights=[6e8, 6e8], max_abs_reward=100.0, use_cpu=True)


def test_large_weights_at_the_edge_keep_the_weighted_sum_finite(tmp_path, tokenizer):
    def at_bound(completion_ids, **kwargs):
        return [DEFAULT_MAX_ABS_REWARD * (-1) ** i for i in range(len(completion_ids))]

    args = tiny_grpo_args(tmp_path, num_generations=4, max_completion_length=4, reward_weights=[5e8, 5e8])
    trainer = GRPOTrainer(
        model=build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=[at_bound, at_bound],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": SHORT_PROMPTS}),
        processing_class=tokenizer,
    )
    trainer.train()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert math.isfinite(log["loss"]) and math.isfinite(log["reward"]) and log["reward_std"] > 0
