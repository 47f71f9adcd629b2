"""trl_stable.GRPOTrainer with every new option at its default must be TRL's GRPOTrainer, number for number."""

import math

import pytest
import torch
import trl
from datasets import Dataset
from tiny_configs import tiny_grpo_args
from tiny_data import PROMPTS, length_reward

import trl_stable
from trl_stable.testing import build_causal_lm

TRAIN = [*PROMPTS, "The report says", "We met at"]


def great_reward(completions, **kwargs):
    return [float(c.count("great") + c.count("good")) for c in completions]


def none_reward(completions, **kwargs):
    """TRL's "does not apply": None for every third completion, which no other function scores either."""
    return [None if i % 3 == 0 else float(len(c)) / 10.0 for i, c in enumerate(completions)]


def nan_reward(completions, **kwargs):
    """A failed score: NaN, which TRL reads as None."""
    return [math.nan if i % 3 == 1 else float(c.count("e")) for i, c in enumerate(completions)]


def _train(trainer_cls, config_cls, tokenizer, tmp_path, reward_funcs=(length_reward, great_reward), **extra):
    settings = dict(max_completion_length=6, max_steps=3, learning_rate=1e-2, seed=123)
    args = tiny_grpo_args(tmp_path, config_class=config_cls, **{**settings, **extra})
    model = build_causal_lm("qwen2", tokenizer, seed=0)
    trainer = trainer_cls(
        model=model,
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": TRAIN * 2}),
        processing_class=tokenizer,
    )
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer.state.log_history, params


@pytest.mark.parametrize("extra", [{}, {"num_iterations": 2, "gradient_accumulation_steps": 2}])
def test_default_run_matches_trl(tokenizer, tmp_path, extra):
    ours, ours_params = _train(trl_stable.GRPOTrainer, trl_stable.GRPOConfig, tokenizer, tmp_path / "ours", **extra)
    ref, ref_params = _train(trl.GRPOTrainer, trl.GRPOConfig, tokenizer, tmp_path / "ref", **extra)

    step_logs = [h for h in ref if "loss" in h]
    assert len(step_logs) == 3
    # The run must actually learn something, or equality would be trivially true.
    assert any(abs(h["grad_norm"]) > 0 for h in step_logs)
    for ref_h, ours_h in zip(ref, ours):
        for key in ("loss", "grad_norm", "reward", "reward_std", "rewards/length_reward/mean", "entropy"):
            if key in ref_h:
                assert key in ours_h, f"{key} missing from trl_stable's log"
                assert math.isclose(ref_h[key], ours_h[key], rel_tol=0, abs_tol=1e-7), (key, ref_h, ours_h)
    for name, p in ref_params.items():
        torch.testing.assert_close(ours_params[name], p, rtol=0, atol=0)


@pytest.mark.parametrize(
    "reward_funcs",
    [(none_reward,), (nan_reward,), (none_reward, nan_reward)],
    ids=["none", "nan", "none+nan"],
)
def test_none_and_nan_rewards_match_trl(tokenizer, tmp_path, reward_funcs):
    """None and NaN rewards, unscorable completions included (every function None/NaN): TRL's numbers exactly."""
    # groups of 4 with two unscorable completions each: the other two still carry a signal
    extra = dict(reward_funcs=reward_funcs, num_generations=4)
    ours, ours_params = _train(trl_stable.GRPOTrainer, trl_stable.GRPOConfig, tokenizer, tmp_path / "ours", **extra)
    ref, ref_params = _train(trl.GRPOTrainer, trl.GRPOConfig, tokenizer, tmp_path / "ref", **extra)
    step_logs = [h for h in ref if "loss" in h]
    assert len(step_logs) == 3 and any(abs(h["grad_norm"]) > 0 for h in step_logs)
    keys = ["loss", "grad_norm", "reward", "reward_std", "entropy"]
    keys += [f"rewards/{f.__name__}/{stat}" for f in reward_funcs for stat in ("mean", "std")]
    for ref_h, ours_h in zip(ref, ours):
        for key in keys:
            if key in ref_h:
                assert key in ours_h, f"{key} missing from trl_stable's log"
                assert _same(ref_h[key], ours_h[key]), (key, ref_h, ours_h)
    for name, p in ref_params.items():
        torch.testing.assert_close(ours_params[name], p, rtol=0, atol=0)


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=0, abs_tol=1e-7)
