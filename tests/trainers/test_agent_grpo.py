"""GRPO on the tiny kit with group arena rewards and with intermediate step rewards (GDPO per dimension)."""

import json
import math

import pytest
import torch
from datasets import Dataset
from tiny_configs import tiny_grpo_args

import trl_stable
from trl_stable.rewards import ArenaReward, StepReward, tool_overuse_penalty
from trl_stable.testing import build_causal_lm

TOOLS_JSON = json.dumps({"get_weather": {"city": "string"}})
PROMPTS = ["Tell me about the weather", "Call a tool for Paris", "What should we do", "Plan the trip"]


def _args(tmp_path, **extra):
    return tiny_grpo_args(tmp_path, **{"num_generations": 4, "learning_rate": 1e-2, "seed": 0, **extra})


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


GOOD_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
BAD_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": 5}}</tool_call>'


class _ScriptedGRPO(trl_stable.GRPOTrainer):
    """Completions are scripted (a random tiny model writes no tool calls); the loss inputs are recorded."""

    scripted: list = []
    seen: list = []

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return [list(self.scripted[i % len(self.scripted)]) for i in range(len(prompt_ids))], None

    def _compute_loss(self, model, inputs):
        self.seen.append({k: v.detach().clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)})
        return super()._compute_loss(model, inputs)


def test_grpo_step_loss_mask_removes_invalid_call_tokens(tokenizer, tmp_path):
    texts = [f"Sure. {GOOD_CALL}", f"Hmm {BAD_CALL} ok", "no tools", f"{BAD_CALL}"]
    scripted = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    _ScriptedGRPO.scripted, _ScriptedGRPO.seen = scripted, []
    trainer = _ScriptedGRPO(
        model=build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=[lambda completions, **kw: [float(len(c)) for c in completions]],
        args=_args(tmp_path, max_completion_length=40, step_loss_mask=True, step_mask_tools=TOOLS_JSON),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
    )
    trainer.train()
    inputs = trainer.seen[0]
    ids, keep = inputs["completion_ids"], inputs["completion_mask"] * inputs.get("tool_mask", 1)
    kept = [tokenizer.decode([t for t, m in zip(row, mask) if m]) for row, mask in zip(ids.tolist(), keep.tolist())]
    assert len(kept) == 4
    for text in kept:
        assert '{"city": 5}' not in text
    expected = [f"Sure. {GOOD_CALL}<|endoftext|>", "Hmm  ok<|endoftext|>", "no tools<|endoftext|>", "<|endoftext|>"]
    assert sorted(kept) == sorted(expected)  # TRL shuffles the batch before the loss
    assert inputs["num_items_in_batch"] == keep.sum()
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert math.isfinite(log["loss"]) and log["step_mask/bad_arguments"] == 2 and log["step_mask/steps"] == 3


def test_grpo_step_mask_config_validation(tmp_path):
    cfg = _args(tmp_path, step_loss_mask=True, step_mask_tools='["get_weather"]')
    assert cfg.step_mask_tools == ["get_weather"]
    with pytest.raises(ValueError, match="step_loss_mask"):
        _args(tmp_path, step_mask_tools=["get_weather"])
    with pytest.raises(ValueError, match="step_mask_tools"):
        _args(tmp_path, step_loss_mask=True, step_mask_tools="{oops")
