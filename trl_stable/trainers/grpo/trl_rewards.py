"""How GRPO's rewards go through `trl.GRPOTrainer._calculate_rewards`: the keywords TRL passes every reward function
(`reward_kwargs`, mirrored for the dense functions trl_stable calls itself; see
`trl_stable.integration.trl_members.MIRRORED`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["reward_kwargs"]


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
