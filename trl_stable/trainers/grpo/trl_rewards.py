"""How GRPO's rewards go through `trl.GRPOTrainer._calculate_rewards`: the reward functions TRL calls, checked under
trl_stable's reward contract (`ContractCheckedRewards`), and the keywords TRL passes every reward function
(`reward_kwargs`, mirrored for the dense functions trl_stable calls itself). See
`trl_stable.integration` (trl_members.GRPO_MEMBERS: reward_funcs; mirrored.MIRRORED)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from trl.trainer.utils import is_async_callable

from trl_stable.rewards.dense import checked_sequence_reward


def reward_kwargs(trainer: Any, inputs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The keyword arguments TRL passes every reward function (mirrors `trl.GRPOTrainer._calculate_rewards`).

    The dataset columns (repeated per completion), ``trainer_state``, ``log_extra``, ``log_metric`` and, with
    environments, ``environments``. See `MIRRORED`.
    """
    keys = [key for key in inputs[0] if key not in ("prompt", "completion", "completion_ids")]
    kwargs: dict[str, Any] = {key: [example[key] for example in inputs] for key in keys}
    kwargs["trainer_state"] = trainer.state
    kwargs["log_extra"] = trainer._log_completion_extra
    kwargs["log_metric"] = trainer._log_metric
    if trainer.environments is not None:
        kwargs["environments"] = trainer.environments
    return kwargs


class ContractCheckedRewards:
    """The reward functions TRL's `_calculate_rewards` calls, each answer read under `trl_stable.rewards.dense`'s
    contract, built once (the trainer puts `funcs` in TRL's `reward_funcs` at construction; nothing swaps them later).

    Each callable function is wrapped by `checked_sequence_reward`: the wrapper hands TRL exactly the values TRL would
    have built itself from a well-formed answer (a float per completion, None -> NaN), so the numbers are TRL's; an
    answer that is not numbers is replaced by None for every completion and its error kept in `errors`, so every
    process still reaches TRL's gather after the functions; a call that raises leaves its completions unscored, with
    its cause in `failures` (the trainer's guard counts it). The trainer takes both (`take_errors`) after each call and
    raises the first error on every process; out-of-range values are bounded on the gathered rewards. Reward models
    (``nn.Module``) are TRL's to score and are left as they are. A wrapper keeps its function's name and
    ``__wrapped__`` (``inspect.unwrap`` gives the function back).

    Args:
        funcs: TRL's reward functions, in `reward_funcs` order.
        names: Their names (`reward_func_names`).
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
