"""PPOTrainer.evaluate and Trainer's evaluation machinery (eval_strategy, metric_for_best_model,
load_best_model_at_end), and nan_reward_action for PPO."""

import math
import os

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from tiny_configs import step_logs, tiny_ppo_args
from tiny_data import SHORT_PROMPTS

from trl_stable import PPOTrainer
from trl_stable.rewards import dense_reward
from trl_stable.testing import build_causal_lm

TRAIN = SHORT_PROMPTS * 2
EVAL = ["Great acting", "The plot", "Nobody", "Once upon", "It was"]


class Recorder:
    """A sequence reward (the completion's length / 4) that records what it scored, by prompt."""

    __name__ = "length"

    def __init__(self):
        self.seen = []

    def __call__(self, prompts, completion_ids, **kwargs):
        self.seen += list(zip(prompts, [len(c) for c in completion_ids]))
        return [len(c) / 4 for c in completion_ids]


def _trainer(tmp_path, tokenizer, reward_funcs, **overrides):
    args = tiny_ppo_args(tmp_path, learning_rate=1e-3, **overrides)
    return PPOTrainer(
        build_causal_lm("gpt2", tokenizer, seed=0),
        reward_funcs=reward_funcs,
        args=args,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": TRAIN}),
        eval_dataset=Dataset.from_dict({"prompt": EVAL}),
    )


def test_evaluate_generates_on_every_eval_prompt_and_scores_it(tmp_path, tokenizer):
    recorder = Recorder()

    @dense_reward
    def half_per_token(prompts, completions, completion_ids, **kwargs):
        return [[0.5] * len(c) for c in completion_ids]

    trainer = _trainer(tmp_path, tokenizer, [recorder, half_per_token], per_device_eval_batch_size=2)
    metrics = trainer.evaluate()
    # every eval prompt once (5 prompts in batches of 2), in order
    assert [p for p, _ in recorder.seen] == EVAL
    lengths = torch.tensor([n for _, n in recorder.seen], dtype=torch.float64)
    assert metrics["eval_rewards/length/mean"] == pytest.approx((lengths / 4).mean().item())
    assert metrics["eval_dense/reward_mean"] == pytest.approx((0.5 * lengths).mean().item())
    assert metrics["eval_reward"] == pytest.approx((lengths / 4 + 0.5 * lengths).mean().item())
    assert metrics["eval_completions/mean_length"] == pytest.approx(lengths.mean().item())
    assert metrics["eval_runtime"] > 0 and trainer.state.log_history[-1]["eval_reward"] == metrics["eval_reward"]
    assert trainer.state.global_step == 0  # no training step

    by_name = trainer.evaluate({"short": Dataset.from_dict({"prompt": EVAL[:2]})})
    assert by_name["eval_short_rewards/length/mean"] == pytest.approx(
        torch.tensor([n / 4 for _, n in recorder.seen[-2:]]).mean().item()
    )


def test_eval_strategy_steps_evaluates_during_train(tmp_path, tokenizer):
    trainer = _trainer(tmp_path, tokenizer, Recorder(), max_steps=4, eval_strategy="steps", eval_steps=2)
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_reward" in h]
    assert [h["step"] for h in evals] == [2, 4] and all(math.isfinite(h["eval_reward"]) for h in evals)
    assert len(step_logs(trainer)) == 4


def test_eval_strategy_without_eval_dataset_is_refused_by_trainer(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="eval_dataset"):
        PPOTrainer(
            build_causal_lm("gpt2", tokenizer, seed=0),
            reward_funcs=Recorder(),
            args=tiny_ppo_args(tmp_path, eval_strategy="steps", eval_steps=1),
            processing_class=tokenizer,
            train_dataset=Dataset.from_dict({"prompt": TRAIN}),
        )


def test_load_best_model_at_end_restores_the_best_checkpoint(tmp_path, tokenizer):
    trainer = _trainer(
        tmp_path,
        tokenizer,
        Recorder(),
        max_steps=4,
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        metric_for_best_model="reward",
        greater_is_better=False,  # the run's last checkpoint is rarely the best by this measure: a real choice
        load_best_model_at_end=True,
    )
    trainer.train()
    evals = {h["step"]: h["eval_reward"] for h in trainer.state.log_history if "eval_reward" in h}
    best_step = min(evals, key=evals.get)
    assert trainer.state.best_model_checkpoint == os.path.join(str(tmp_path), f"checkpoint-{best_step}")
    saved = load_file(os.path.join(trainer.state.best_model_checkpoint, "model.safetensors"))
    policy = trainer.policy.state_dict()
    for name, tensor in saved.items():
        torch.testing.assert_close(policy[name], tensor, msg=name)
    head = load_file(os.path.join(trainer.state.best_model_checkpoint, "value_head.safetensors"))
    torch.testing.assert_close(trainer.unwrapped().value_head.summary.weight, head["summary.weight"])


QUERIES = [torch.tensor([5, 6]), torch.tensor([7]), torch.tensor([8, 9, 10]), torch.tensor([11])]
RESPONSES = [torch.tensor([20, 21, 22, 23]), torch.tensor([24, 25]), torch.tensor([26, 27, 28]), torch.tensor([29])]


def _step_batches(tmp_path, tokenizer, action, scores):
    trainer = PPOTrainer(
        build_causal_lm("gpt2", tokenizer, seed=0),
        args=tiny_ppo_args(tmp_path, nan_reward_action=action),
        processing_class=tokenizer,
    )
    seen = {}
    real = trainer.update

    def spy(batch):
        seen.update(batch)
        return real(batch)

    trainer.update = spy
    with pytest.warns(UserWarning, match="NaN or infinite reward"):
        stats = trainer.step(QUERIES, RESPONSES, scores=scores)
    return seen, stats


def _refused(tmp_path, tokenizer, scores):
    trainer = PPOTrainer(
        build_causal_lm("gpt2", tokenizer, seed=0), args=tiny_ppo_args(tmp_path), processing_class=tokenizer
    )
    with pytest.raises(ValueError, match="Every sample of the batch has a NaN"):
        trainer.step(QUERIES, RESPONSES, scores=scores)


def test_nan_reward_action_zero_keeps_the_sample_with_advantage_zero_and_no_value_loss(tmp_path, tokenizer):
    scores = [math.nan, 1.0, 0.0, 0.5]
    zero, zero_stats = _step_batches(tmp_path / "zero", tokenizer, "zero", scores)
    assert zero["response_mask"][0, :4].tolist() == [1.0] * 4  # still in the policy loss's token count
    assert zero["advantages"][0].abs().sum() == 0  # ... with no policy gradient
    assert zero["value_mask"][0].sum() == 0 and zero["value_mask"][1:].equal(zero["response_mask"][1:])
    assert zero_stats["ppo/zeroed_samples"] == 1.0 and "ppo/dropped_samples" not in zero_stats
    # the other samples' advantages are whitened over the scored samples only: mean 0, std 1 over their tokens
    scored = zero["value_mask"].bool()
    assert zero["advantages"][scored].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert zero["advantages"][scored].std().item() == pytest.approx(1.0, abs=1e-3)

    drop, drop_stats = _step_batches(tmp_path / "drop", tokenizer, "drop", scores)
    assert drop["response_mask"][0].sum() == 0 and drop_stats["ppo/dropped_samples"] == 1.0


def test_nan_reward_action_zero_trains_on_a_batch_without_any_reward(tmp_path, tokenizer):
    _refused(tmp_path / "drop", tokenizer, [math.nan] * 4)  # the default, "drop"
    zero, stats = _step_batches(tmp_path / "zero", tokenizer, "zero", [math.nan] * 4)
    assert zero["advantages"].abs().sum() == 0 and stats["ppo/zeroed_samples"] == 4.0
    assert stats["loss/value"] == 0.0
