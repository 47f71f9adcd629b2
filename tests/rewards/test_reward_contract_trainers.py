"""`trl_stable.rewards.dense`'s NaN / None / inf contract holds in both trainers, on the same reward outputs."""

import pytest
import torch
from datasets import Dataset

from trl_stable import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer
from trl_stable.rewards import dense_reward
from trl_stable.rewards.dense import RewardContractError
from trl_stable.testing import build_causal_lm

NAN, INF = float("nan"), float("inf")
PROMPTS = ["The movie was", "I think the", "The weather today", "She walked to"]


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


def train(kind, tokenizer, tmp_path, funcs):
    model = build_causal_lm("qwen2", tokenizer, seed=0)
    common = dict(output_dir=str(tmp_path), max_steps=1, logging_steps=1, report_to="none", save_strategy="no")
    if kind == "ppo":
        args = PPOConfig(batch_size=4, mini_batch_size=2, ppo_epochs=1, max_new_tokens=5, disable_tqdm=True, **common)
        trainer = PPOTrainer(model, funcs, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                             processing_class=tokenizer)  # fmt: skip
    else:
        args = GRPOConfig(per_device_train_batch_size=4, num_generations=2, max_completion_length=5, use_cpu=True,
                          **common)  # fmt: skip
        trainer = GRPOTrainer(model, funcs, args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS[:2] * 2}),
                              processing_class=tokenizer)  # fmt: skip
    trainer.train()
    return next(entry for entry in trainer.state.log_history if "rewards/dense/nan_tokens" in entry)


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
def test_none_and_nan_do_not_apply(kind, tokenizer, tmp_path):
    # completions 0 and 1: no sequence-level function applies (None, NaN): both trainers drop them
    seen = []
    logs = train(kind, tokenizer, tmp_path, make_funcs([None, NAN, 1.0, 0.5], seen=seen))
    dropped = logs["ppo/dropped_samples"] if kind == "ppo" else logs["rewards/nan_dropped"]
    assert dropped == 2.0
    # the dense NaN token counts as 0 and is reported; the None row is zeros: only completions 2 and 3 add 0.5 a token
    ids = seen[0]
    assert logs["rewards/dense/nan_tokens"] == 1.0
    assert logs["rewards/dense/sum_mean"] == pytest.approx(0.5 * (len(ids[2]) + len(ids[3])) / 4)
    assert logs["rewards/dense/token_mean"] == pytest.approx(0.5 * (len(ids[2]) + len(ids[3])) / sum(map(len, ids)))


@pytest.mark.parametrize("kind", ["ppo", "grpo"])
def test_infinite_rewards_stop_at_their_source(kind, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="'seq' returned inf for completion 2"):
        train(kind, tokenizer, tmp_path / "seq", make_funcs([0.0, 1.0, INF, 0.5]))
    with pytest.raises(ValueError, match="'dense' returned -inf at token 0 of completion 0"):
        train(kind, tokenizer, tmp_path / "dense", make_funcs([0.0, 1.0, 0.0, 0.5], dense_first_token=-INF))


def test_the_step_api_takes_final_rewards(tokenizer, tmp_path):
    """`PPOTrainer.step` gets final per-token rewards (RELC puts the score inside them): a NaN marks a sample without
    a reward and drops it; an infinite value raises, as everywhere."""
    args = PPOConfig(output_dir=str(tmp_path), batch_size=2, mini_batch_size=2, ppo_epochs=1, report_to="none",
                     disable_tqdm=True, save_strategy="no")  # fmt: skip
    trainer = PPOTrainer(build_causal_lm("qwen2", tokenizer, seed=0), args=args, processing_class=tokenizer)
    queries = [torch.tensor([5, 6]), torch.tensor([7])]
    responses = [torch.tensor([8, 9]), torch.tensor([10, 11, 12])]
    with pytest.warns(UserWarning, match="Dropping 1 of 2"):
        stats = trainer.step(queries, responses, [[0.0, NAN], [0.0, 0.0, 1.0]])
    assert stats["ppo/dropped_samples"] == 1.0
    with pytest.raises(RewardContractError, match="Sample 1 of this PPO step has an infinite reward"):
        trainer.step(queries, responses, [[0.0, 1.0], [0.0, INF, 1.0]])
    with pytest.raises(RewardContractError, match="Sample 0"):
        trainer.step(queries, responses, scores=[-INF, 0.0])
