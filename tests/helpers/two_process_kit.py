"""What the two-process scripts share: a tiny model whose completions end at different lengths on each process, and
reward functions that record what each process saw (the test recomputes from the records of both processes the
metrics one process holding the global batch would log).

Imported by name from the scripts `two_processes.launch_two_processes` starts (this folder is on their PYTHONPATH).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from trl_stable.rewards import CriticIntrinsicReward, CriticRewardConfig
from trl_stable.testing import build_causal_lm


def uneven_lm(family: str, tokenizer) -> torch.nn.Module:
    """The tiny kit's `family` model (seed 0) with its EOS logit raised by 5: it ends a completion about every 7th
    token, so the processes hold completions of different lengths."""
    model = build_causal_lm(family, tokenizer, seed=0)
    bias = torch.zeros(len(tokenizer))
    bias[tokenizer.eos_token_id] = 5.0
    model.lm_head.register_forward_hook(lambda module, inputs, logits: logits + bias)
    return model


class DenseRecorder:
    """A dense reward function giving `rows(completion_ids)`, named like `rows`; each call appends to `seen` its step,
    the sum of its finite values, its number of tokens, of rows and of NaN values."""

    dense = True  # trl_stable.rewards.dense_reward's mark, on an instance

    def __init__(self, rows: Callable[[list[list[int]]], list[list[float]]]):
        self.rows = rows
        self.__name__ = rows.__name__
        self.seen: list[dict] = []

    def __call__(self, completion_ids, trainer_state, **kwargs) -> list[list[float]]:
        rows = self.rows(completion_ids)
        values = [v for row in rows for v in row]
        self.seen.append(
            {
                "step": trainer_state.global_step,
                "sum": sum(v for v in values if not math.isnan(v)),
                "tokens": len(values),
                "rows": len(rows),
                "nan": sum(math.isnan(v) for v in values),
            }
        )
        return rows


class RecordingCritic(CriticIntrinsicReward):
    """The lexicon critic's intrinsic reward on every sample (threshold inf); each call appends to `seen` its step and
    the critic's metrics of that call (`last_metrics`: the ``critic/step_<counter>`` counts, fractions and stage
    seconds)."""

    def __init__(self, tokenizer):
        super().__init__(CriticRewardConfig(use_intrinsic_reward=True, intrinsic_reward_threshold=math.inf), tokenizer)
        self.seen: list[dict] = []

    def __call__(self, *args, trainer_state=None, **kwargs):
        rows = super().__call__(*args, trainer_state=trainer_state, **kwargs)
        self.seen.append({"step": trainer_state.global_step, **self.last_metrics})
        return rows
