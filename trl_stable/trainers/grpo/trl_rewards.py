"""How GRPO's rewards go through `trl.GRPOTrainer._calculate_rewards`: the reward functions TRL calls, checked under
trl_stable's reward contract, and the keywords TRL passes them (`trl_stable.integration`: GRPO_MEMBERS, MIRRORED)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from trl.trainer.utils import is_async_callable

from trl_stable.rewards.dense import checked_sequence_reward


def reward_kwargs(trainer: Any, inputs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The keyword arguments TRL passes every reward function (mirrors `trl.GRPOTrainer._calculate_rewards`)."""
    keys = [key for key in inputs[0] if key not in ("prompt", "completion", "completion_ids")]
    kwargs: dict[str, Any] = {key: [example[key] for example in inputs] for key in keys}
    kwargs.update(trainer_state=trainer.state, log_extra=trainer._log_completion_extra, log_metric=trainer._log_metric)
    if trainer.environments is not None:
        kwargs["environments"] = trainer.environments
    return kwargs


class ContractCheckedRewards:
    """TRL's `reward_funcs`, built once (the trainer sets them at construction), each answer read under
    `trl_stable.rewards.dense`'s contract (`checked_sequence_reward`): TRL gets the values it would build from a
    well-formed answer; a malformed answer becomes None for every completion (its error in `errors`) and a raising
    call leaves its completions unscored (its cause in `failures`), so every process still reaches TRL's gather.
    Reward models are left as they are; a wrapper keeps its function's name and ``__wrapped__``.
    """

    def __init__(self, funcs: Sequence[Any], names: Sequence[str]):
        self.errors: list[Exception] = []
        self.failures: dict[str, str] = {}  # per function whose call raised in this call, the cause
        self.originals = list(funcs)
        self.funcs = [self._checked(func, name) for func, name in zip(funcs, names, strict=True)]

    def _checked(self, func: Any, name: str) -> Any:
        if isinstance(func, torch.nn.Module):
            return func
        is_async = is_async_callable(func)
        wrapper = checked_sequence_reward(func, name, self.errors, is_async=is_async, failures=self.failures)
        return functools.update_wrapper(wrapper, func, assigned=("__module__", "__name__", "__qualname__"), updated=())

    def take_errors(self) -> tuple[list[Exception], dict[str, str]]:
        """The contract errors (and `RewardComponentFailure`s) of the call since the last `take_errors`, in the order
        found, and the causes of the functions whose call raised; both are emptied."""
        errors, failures = list(self.errors), dict(self.failures)
        self.errors.clear()
        self.failures.clear()
        return errors, failures
