"""Errors that stop every process together: a check that fails on one process of a distributed run is raised on
all of them, so none is left waiting in a collective (a gather, a reduce) the failing one never reaches; likewise a
reward function's failed step is counted on every process's outcome."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from trl_stable.rewards.dense import RewardContractError, record_reward_failures
from trl_stable.rewards.failure_guard import FailureGuard, RewardComponentFailure


def raise_on_every_process(
    error: Exception | None, accelerator: Any, elsewhere: Callable[[], Exception] | None = None
) -> None:
    """Raise on every process when any process found `error`, so none is left waiting in a collective (a
    collective: every process calls it). `elsewhere` makes the error the other processes raise (default: a
    `RewardContractError` pointing at the other process's message)."""
    flag = torch.tensor(float(error is not None), device=accelerator.device)
    if accelerator.reduce(flag, reduction="sum").item() > 0:
        if error is not None:
            raise error
        if elsewhere is not None:
            raise elsewhere()
        raise RewardContractError(
            "A reward function broke the reward contract on another process (a wrong count, or a value that is not a "
            "number); that process's error names the function."
        )


def call_on_every_process(accelerator: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, where a `RewardContractError` (or a reward component's `RewardComponentFailure`) raised on any
    one process is raised on every process (`raise_on_every_process`); a collective: every process must call this."""
    error = result = None
    try:
        result = fn(*args)
    except (RewardContractError, RewardComponentFailure) as err:
        error = err
    raise_on_every_process(error, accelerator)
    return result


def guard_reward_failures(
    accelerator: Any,
    guards: dict[str, FailureGuard],
    names: Sequence[str],
    values: torch.Tensor | None,
    failures: dict[str, str],
    everywhere: bool = True,
) -> None:
    """Count a step in which a reward function failed wholesale (`reward_max_failing_steps`): no usable value in
    `values` [N, K] (on every process, with `everywhere`), or else its call raised on some process; decided on every
    process's outcome, so every process stops at the same step."""
    if not names:
        return
    if values is not None:
        local = torch.isnan(values).all(dim=0).float()
    else:
        local = torch.tensor([float(name in failures) for name in names])
    counts = accelerator.reduce(local.to(accelerator.device), reduction="sum")
    failed = counts >= accelerator.num_processes if everywhere else counts > 0
    record_reward_failures(guards, dict(zip(names, failed.tolist())), failures)
