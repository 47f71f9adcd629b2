"""GRPO on the tiny kit with group arena rewards and with intermediate step rewards (GDPO per dimension)."""

import json
import math

import pytest
from datasets import Dataset

import trl_stable
from trl_stable.rewards import ArenaReward, StepReward, tool_overuse_penalty
from trl_stable.testing import build_causal_lm

PROMPTS = ["Tell me about the weather", "Call a tool for Paris", "What should we do", "Plan the trip"]


def _args(tmp_path, **extra):
    return trl_stable.GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=1, learning_rate=1e-2, logging_steps=1, seed=0, report_to="none", save_strategy="no",
        use_cpu=True, **extra,
    )  # fmt: skip


def by_length(prompt, a, b):
    return 1.0 if len(a) > len(b) else 0.0 if len(a) < len(b) else 0.5


@pytest.mark.parametrize("pairing", ["round_robin", "swiss"])
def test_grpo_trains_with_gar(tokenizer, tmp_path, pairing):
    arena = ArenaReward(by_length, pairing=pairing)
    trainer = trl_stable.GRPOTrainer(
        model=build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=[arena],
        args=_args(tmp_path),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 1 and math.isfinite(logs[0]["loss"])
    log = logs[0]
    assert 0.0 <= log[f"rewards/arena_{pairing}/mean"] <= 1.0
    # One group of 4 per step: round robin 6 pairs, Swiss 2 rounds x 2 matches; both orders.
    expected_calls = 12 if pairing == "round_robin" else 8
    assert log["arena/judge_calls"] == expected_calls and log["arena/failed_judge_calls"] == 0
    assert arena.judge_calls == expected_calls


def test_grpo_trains_with_step_rewards_per_dimension(tokenizer, tmp_path):
    truth = json.dumps({"tool": "get_weather", "arguments": {"city": "Paris"}, "plan": ["look up"]})
    step = StepReward(penalties=[tool_overuse_penalty("get_weather", 1)])
    data = Dataset.from_dict({"prompt": PROMPTS, "ground_truth": [truth] * len(PROMPTS)})
    trainer = trl_stable.GRPOTrainer(
        model=build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=[step, *step.reward_funcs()],
        args=_args(
            tmp_path, reward_weights=[0.0, *step.reward_weights()], multi_objective_aggregation="normalize_then_sum"
        ),
        train_dataset=data,
        processing_class=tokenizer,
    )
    trainer.train()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert math.isfinite(log["loss"])
    for name in ("step_reward", "step_tool_name", "step_arguments", "step_reasoning", "step_plan", "step_penalty"):
        assert f"rewards/{name}/mean" in log
    # The random tiny model calls no tool and writes no plan: the plan and tool-name dimensions score 0.
    assert log["rewards/step_tool_name/mean"] == 0.0 and log["rewards/step_plan/mean"] == 0.0
