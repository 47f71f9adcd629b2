"""`trl_stable.rewards.dense`'s NaN / None / inf contract holds in both trainers, on the same reward outputs."""

import math

import pytest
import torch
from datasets import Dataset
from tiny_configs import tiny_grpo_args, tiny_ppo_args
from tiny_data import PROMPTS

from trl_stable import GRPOTrainer, PPOTrainer
from trl_stable.rewards import dense_reward
from trl_stable.rewards.dense import RewardTypeError
from trl_stable.testing import build_causal_lm

NAN, INF = float("nan"), float("inf")


def make_funcs(sequence_values, dense_first_token=NAN, seen=None):
    """A sequence-level and a dense reward function that answer by position in the batch of four completions."""

    def seq(completion_ids, **kwargs):
        return list(sequence_values)

    @dense_reward
    def dense(completion_ids, **kwargs):
        if seen is not None:
            seen.append([list(ids) for ids in completion_ids])
        # completion 0: one token value (NaN by default), completion 1: no dense reward, the rest finite
        rows = [[dense_first_token] + [0.0] * (len(ids) - 1) for ids in completion_ids[:1]]
        return rows + [None] + [[0.5] * len(ids) for ids in completion_ids[2:]]

    return [seq, dense]


def train(kind, tokenizer, tmp_path, funcs, max_steps=1, **grpo_options):
    """One short `train()`; GRPO with `nan_reward_action="drop"` (PPO always drops unscorable samples)."""
    model = build_causal_lm("qwen2", tokenizer, seed=0)
    if kind == "ppo":
        args = tiny_ppo_args(tmp_path, max_steps=max_steps, logging_steps=1)
        trainer = PPOTrainer(model, funcs, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                             processing_class=tokenizer)  # fmt: skip
    else:
        grpo_options = {"nan_reward_action": "drop", **grpo_options}
        args = tiny_grpo_args(tmp_path, max_completion_length=5, max_steps=max_steps, **grpo_options)
        trainer = GRPOTrainer(model, funcs, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2] * 2}),
                              processing_class=tokenizer)  # fmt: skip
    trainer.train()
    return trainer, next(entry for entry in trainer.state.log_history if "rewards/dense/nan_tokens" in entry)


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
def test_none_and_nan_do_not_apply(kind, tokenizer, tmp_path):
    # completions 0 and 1: no sequence-level function applies (None, NaN): both trainers drop them
    seen = []
    _, logs = train(kind, tokenizer, tmp_path, make_funcs([None, NAN, 1.0, 0.5], seen=seen))
    dropped = logs["ppo/dropped_samples"] if kind == "ppo" else logs["rewards/nan_dropped"]
    assert dropped == 2.0
    # the dense NaN token counts as 0 and is reported; the None row is zeros: only completions 2 and 3 add 0.5 a token
    ids = seen[0]
    assert logs["rewards/dense/nan_tokens"] == 1.0
    assert logs["rewards/dense/sum_mean"] == pytest.approx(0.5 * (len(ids[2]) + len(ids[3])) / 4)
    assert logs["rewards/dense/token_mean"] == pytest.approx(0.5 * (len(ids[2]) + len(ids[3])) / sum(map(len, ids)))


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
def test_infinite_rewards_are_treated_as_nan(kind, tokenizer, tmp_path, caplog):
    # completion 2's only sequence reward is inf: it has no reward, like completion 1's NaN; the dense -inf at token 0
    # of completion 0 counts as a NaN token (0)
    with caplog.at_level("WARNING"):
        _, logs = train(kind, tokenizer, tmp_path, make_funcs([0.0, NAN, INF, 0.5], dense_first_token=-INF))
    dropped = logs["ppo/dropped_samples"] if kind == "ppo" else logs["rewards/nan_dropped"]
    assert dropped == 2.0
    assert logs["rewards/dense/nan_tokens"] == 1.0
    assert "'seq' returned inf for completion 2" in caplog.text
    assert "'dense' returned -inf for token 0 of completion 0" in caplog.text


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
def test_non_numeric_rewards_raise_type_errors_naming_function_and_sample(kind, tokenizer, tmp_path):
    with pytest.raises(TypeError, match="'seq' returned '0.5' \\(str\\) for completion 1, which is not a number"):
        train(kind, tokenizer, tmp_path / "seq", make_funcs([0.0, "0.5", 0.0, 0.5]))
    with pytest.raises(TypeError, match="'dense' returned '1' \\(str\\) for token 0 of completion 0"):
        train(kind, tokenizer, tmp_path / "dense", make_funcs([0.0, 1.0, 0.0, 0.5], dense_first_token="1"))


def test_grpo_infinite_rewards_with_a_trl_stable_estimator_train_on(tokenizer, tmp_path):
    """+inf from a sequence function and a +inf dense token with RLOO (trl_stable's advantages): finite advantages
    and losses over two steps (the second generates with the first step's weights). Before, the advantages were
    -3.4e38 and the next `generate` died on an inf/NaN probability."""

    def seq(completion_ids, **kwargs):
        return [INF if i == 0 else float(len(ids)) + i for i, ids in enumerate(completion_ids)]

    @dense_reward
    def dense(completion_ids, **kwargs):
        return [[INF if i == 1 else 0.1] * len(ids) for i, ids in enumerate(completion_ids)]

    trainer, _ = train("grpo", tokenizer, tmp_path, [seq, dense], max_steps=2, advantage_estimator="rloo")
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert len(steps) == 2
    assert all(math.isfinite(h["loss"]) and math.isfinite(h["grad_norm"]) for h in steps)
    assert all(h["rewards/dense/nan_tokens"] >= 1 for h in steps)
    advantages = list(trainer._logs["advantages"])
    assert advantages and all(math.isfinite(a) and abs(a) < 100 for a in advantages)
    assert any(a != 0 for a in advantages)


def test_the_step_api_takes_final_rewards(tokenizer, tmp_path):
    """`PPOTrainer.step` gets final per-token rewards and scores (RELC puts the score inside them): a NaN or infinite
    value marks a sample without a reward and drops it; a value that is not a number raises, naming the sample."""
    args = tiny_ppo_args(tmp_path, batch_size=2, mini_batch_size=2)
    trainer = PPOTrainer(build_causal_lm("qwen2", tokenizer, seed=0), args=args, processing_class=tokenizer)
    queries = [torch.tensor([5, 6]), torch.tensor([7])]
    responses = [torch.tensor([8, 9]), torch.tensor([10, 11, 12])]
    with pytest.warns(UserWarning, match="Dropping 1 of 2"):
        stats = trainer.step(queries, responses, [[0.0, NAN], [0.0, 0.0, 1.0]])
    assert stats["ppo/dropped_samples"] == 1.0
    with pytest.warns(UserWarning, match="Dropping 1 of 2"):
        stats = trainer.step(queries, responses, [[0.0, 1.0], [0.0, INF, 1.0]])
    assert stats["ppo/dropped_samples"] == 1.0
    with pytest.warns(UserWarning, match="Dropping 1 of 2"):
        stats = trainer.step(queries, responses, scores=[-INF, torch.tensor(0.5)])
    assert stats["ppo/dropped_samples"] == 1.0
    with pytest.raises(RewardTypeError, match="step\\(\\)'s scores returned '0.5' \\(str\\) for sample 1"):
        trainer.step(queries, responses, scores=[0.0, "0.5"])
    with pytest.raises(TypeError, match="token 1 of sample 0"):
        trainer.step(queries, responses, [[0.0, [1.0]], [0.0, 0.0, 1.0]])
    with pytest.raises(TypeError, match="token_rewards\\[1\\] is 0.5 \\(float\\)"):
        trainer.step(queries, responses, [[0.0, 1.0], 0.5])
    with pytest.raises(TypeError, match="step\\(\\)'s scores is 0.5 \\(float\\)"):
        trainer.step(queries, responses, scores=0.5)
