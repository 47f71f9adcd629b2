"""PPO's GDPO multi-reward normalisation: `multi_objective_aggregation="normalize_then_sum"` in `train()`."""

import pytest
import torch
from datasets import Dataset
from tiny_configs import tiny_ppo_args
from tiny_data import SHORT_PROMPTS

from trl_stable import PPOConfig, PPOTrainer
from trl_stable.core import gdpo_scores
from trl_stable.testing import build_causal_lm


def _length(completion_ids, **kwargs):
    return [float(len(c)) for c in completion_ids]


def _first_id(completion_ids, **kwargs):
    return [1000.0 * c[0] for c in completion_ids]  # a reward whose unit dwarfs the other's


def _scores_seen(tmp_path, tokenizer, aggregation):
    ds = Dataset.from_dict({"prompt": SHORT_PROMPTS})
    args = tiny_ppo_args(tmp_path, max_steps=1, reward_weights=[1.0, 0.5], multi_objective_aggregation=aggregation)
    trainer = PPOTrainer(
        build_causal_lm("qwen2", tokenizer, seed=0),
        reward_funcs=[_length, _first_id],
        args=args,
        processing_class=tokenizer,
        train_dataset=ds,
    )
    seen = {}
    real = trainer.step

    def spy(queries, responses, **kwargs):
        seen["responses"] = [r.tolist() for r in responses]
        seen["scores"] = kwargs["scores"].clone()
        return real(queries, responses, **kwargs)

    trainer.step = spy
    trainer.train()
    return seen


@pytest.mark.parametrize("aggregation", ["sum", "normalize_then_sum"])
def test_train_scores_follow_the_aggregation(tmp_path, tokenizer, aggregation):
    seen = _scores_seen(tmp_path, tokenizer, aggregation)
    raw = torch.tensor([[float(len(r)), 1000.0 * r[0]] for r in seen["responses"]], dtype=torch.float64)
    if aggregation == "sum":
        expected = raw @ torch.tensor([1.0, 0.5], dtype=torch.float64)
    else:
        expected = gdpo_scores(raw, [1.0, 0.5])
        assert expected.abs().max() < 10  # normalised: the x1000 reward no longer sets the scale
    torch.testing.assert_close(seen["scores"].double(), expected)


def test_aggregation_is_validated(tmp_path):
    with pytest.raises(ValueError, match="multi_objective_aggregation must be one of"):
        PPOConfig(output_dir=str(tmp_path), multi_objective_aggregation="gdpo")
