"""The dense (per-token) reward-function contract shared by the GRPO and PPO trainers.

A dense reward function has TRL's reward-function signature and is marked with `dense_reward`:

    @dense_reward
    def my_reward(prompts, completions, completion_ids, env_rewards=None, **kwargs) -> list[list[float] | None]:
        ...

It returns one entry per completion: a list of floats aligned to that completion's tokens
(``len(out[i]) == len(completion_ids[i])``), or None for "no dense reward" (zeros). Trainers call dense reward
functions *after* the sequence-level ones and pass ``env_rewards``: per completion, the weighted sum of the
sequence-level rewards (so a critic can, e.g., only critique samples whose environment reward is low).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

DENSE_ATTR = "dense"


def dense_reward(func: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `func` as a dense (per-token) reward function; returns `func` itself."""
    setattr(func, DENSE_ATTR, True)
    return func


def is_dense_reward(func: Any) -> bool:
    """Whether `func` was declared a dense reward function (with `dense_reward` or ``func.dense = True``)."""
    return bool(getattr(func, DENSE_ATTR, False))


def validate_dense_rewards(
    rewards: Sequence[Sequence[float] | None], completion_lengths: Sequence[int], name: str = "reward function"
) -> list[list[float]]:
    """Check a dense reward function's output and return it as lists of floats (None -> zeros).

    Raises:
        ValueError: naming `name` when the number of entries or a per-token length does not match, so the bug is
            found at its source rather than as a shape error deep inside the loss.
    """
    if len(rewards) != len(completion_lengths):
        raise ValueError(
            f"Dense {name} returned {len(rewards)} entries for {len(completion_lengths)} completions; "
            "return exactly one list (or None) per completion."
        )
    out = []
    for i, (row, length) in enumerate(zip(rewards, completion_lengths)):
        if row is None:
            out.append([0.0] * length)
            continue
        row = [float(v) for v in row]
        if len(row) != length:
            raise ValueError(
                f"Dense {name} returned {len(row)} token rewards for completion {i}, which has {length} tokens; "
                "align the per-token rewards to `completion_ids[i]`."
            )
        out.append(row)
    return out


def has_nan(row: Sequence[float]) -> bool:
    return any(math.isnan(v) for v in row)
