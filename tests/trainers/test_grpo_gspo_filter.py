"""GSPO (sequence-level importance sampling) with an IcePop filter: the filtered token leaves the sequence ratio.

The loss is TRL's own `_compute_loss`, fed a hand-made 2-token batch; only the policy's log-probs are fixed by hand.
AReaL averages the sequence log-ratio over the kept tokens: token 0 is kept (log-ratio 0.1, behaviour weight 1),
token 1 is filtered (behaviour weight e^2 > 5): ratio e^0.1, loss -e^0.1 / 2 = -0.5526 (dapo, pre-mask count 2).
Folding the filter into the advantage only would leave token 1 in the ratio: e^((0.1 - 0.5) / 2), loss -0.4094.
"""

import logging
import math

import pytest
import torch
from datasets import Dataset
from tiny_configs import tiny_grpo_args

from trl_stable import GRPOTrainer
from trl_stable.testing import build_causal_lm

PROX = [-1.0, -1.0]  # the proximal (rollout-weight) log-probs
BEHAV = [-1.0, -3.0]  # the sampler's: token 1's behaviour weight is e^2 ~ 7.4, outside IcePop's [0.5, 5]
THETA = [-0.9, -1.5]  # the updated policy: log-ratios 0.1 and -0.5


def _zero(completions, **kwargs):
    return [0.0] * len(completions)


def _trainer(tokenizer, tmp_path, **config):
    args = tiny_grpo_args(
        tmp_path, per_device_train_batch_size=2, max_completion_length=2, use_decoupled_loss=True, **config
    )
    return GRPOTrainer(
        model=build_causal_lm("qwen2", tokenizer, seed=0), reward_funcs=_zero, args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}), processing_class=tokenizer,
    )  # fmt: skip


def _loss(trainer, batch):
    theta = torch.tensor([THETA])
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (theta, torch.zeros_like(theta), None)
    trainer.model.eval()  # eval: TRL's dapo normaliser is num_items_in_batch itself
    return trainer._compute_loss(trainer.model, batch).item()


def _batch():
    return {
        "prompt_ids": torch.tensor([[5]]),
        "prompt_mask": torch.ones(1, 1, dtype=torch.long),
        "completion_ids": torch.tensor([[6, 7]]),
        "completion_mask": torch.ones(1, 2, dtype=torch.long),
        "advantages": torch.tensor([1.0]),
        "num_items_in_batch": torch.tensor(2.0),
        "old_per_token_logps": torch.tensor([PROX]),
        "sampling_per_token_logps": torch.tensor([BEHAV]),
    }


def test_filtered_token_leaves_the_sequence_ratio(tokenizer, tmp_path):
    trainer = _trainer(tokenizer, tmp_path, importance_sampling_level="sequence", token_filter="icepop")
    batch = _batch()
    trainer._apply_decoupled_loss(batch)
    assert batch["tool_mask"].tolist() == [[1, 0]] and batch["num_items_in_batch"].item() == 2  # pre-mask count
    assert _loss(trainer, batch) == pytest.approx(-math.exp(0.1) / 2, abs=1e-6)  # -0.5526, AReaL's
    # what the advantage fold alone gave (the filtered token still in TRL's sequence ratio)
    folded = {k: v for k, v in batch.items() if k != "tool_mask"}
    assert _loss(trainer, folded) == pytest.approx(-math.exp(-0.2) / 2, abs=1e-6)  # -0.4094


def test_token_level_is_keeps_the_fold(tokenizer, tmp_path):
    """Token-level IS: the fold already removes the token, and the loss mask stays TRL's."""
    trainer = _trainer(tokenizer, tmp_path, token_filter="icepop")
    batch = _batch()
    trainer._apply_decoupled_loss(batch)
    assert "tool_mask" not in batch
    assert _loss(trainer, batch) == pytest.approx(-min(math.exp(0.1), 1.2) / 2, abs=1e-6)


def test_start_up_line_names_the_paths(tokenizer, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="trl_stable.trainers.grpo.grpo_trainer"):
        trainer = _trainer(
            tokenizer, tmp_path, importance_sampling_level="sequence", token_filter="icepop",
            advantage_estimator="rloo",
        )  # fmt: skip
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("trl_stable GRPO:")]
    assert lines == [
        "trl_stable GRPO: advantages=rloo (trl_stable), loss=dapo (TRL, sequence-level IS), decoupled=on, "
        "filter=icepop[0.5,5.0] token/mask, routing=off"
    ]
    assert trainer.describe() == lines[0]
