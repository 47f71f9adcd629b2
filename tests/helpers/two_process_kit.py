"""Reward functions that record what each process saw, for the multi-process scripts: the test recomputes the metrics
one process holding the global batch would log from the records of both processes.

Imported by name from the scripts `two_processes.launch_two_processes` starts (this folder is on their PYTHONPATH).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from trl_stable.rewards import CriticIntrinsicReward


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
    """The critic's intrinsic reward; each call appends to `seen` its step and the critic's metrics of that call
    (`last_metrics`: the ``critic/step_<counter>`` counts, fractions and stage seconds)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[dict] = []

    def __call__(self, *args, trainer_state=None, **kwargs):
        rows = super().__call__(*args, trainer_state=trainer_state, **kwargs)
        self.seen.append({"step": trainer_state.global_step, **self.last_metrics})
        return rows
