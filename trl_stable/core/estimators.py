r"""Advantage estimators behind one registry and one signature (the `core_algos.py` pattern of verl; docs/grpo.md).

Every estimator is ``fn(inputs: AdvantageInputs, **params) -> AdvantageOutputs``: the data of a batch travels in
[`AdvantageInputs`], the estimator's hyper-parameters (eps, gamma, lam, ...) are keyword arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from trl_stable.core.advantages import ngrpo_advantages
from trl_stable.core.gae import compute_gae, compute_turn_gae
from trl_stable.core.normalization import NORMALIZATION_PRESETS, gdpo_advantages, normalize

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "AdvantageInputs",
    "AdvantageOutputs",
    "dr_grpo_estimator",
    "gae_estimator",
    "gdpo_estimator",
    "get_advantage_estimator",
    "grpo_estimator",
    "is_sequence_level",
    "liteppo_estimator",
    "ngrpo_estimator",
    "register_advantage_estimator",
    "rloo_estimator",
    "turn_gae_estimator",
]


@dataclass
class AdvantageInputs:
    """What an advantage estimator may read; each estimator documents the fields it needs.

    Args:
        rewards: [N] sequence rewards (sequence-level estimators) or [B, T] token rewards (gae, turn_gae).
        group_ids: [N] integer prompt-group ids; None: the whole batch is one group.
        rewards_per_func: [N, K] rewards of each reward function (gdpo), NaN where a function does not apply.
        reward_weights: [K] weights of the reward functions; None: all ones.
        mask: [B, T] 1 for action tokens (gae).
        values: [B, T] value estimates (gae, turn_gae).
        bootstrap: [B] value after the last action; None: 0 (terminated).
        turn_ids: [B, T] turn index of each assistant token, -1 elsewhere (turn_gae).
        token_rewards: [B, T] per-token terms added outside the turn recursion (turn_gae, e.g. the KL penalty).
    """

    rewards: torch.Tensor
    group_ids: torch.Tensor | None = None
    rewards_per_func: torch.Tensor | None = None
    reward_weights: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    values: torch.Tensor | None = None
    bootstrap: torch.Tensor | None = None
    turn_ids: torch.Tensor | None = None
    token_rewards: torch.Tensor | None = None


@dataclass
class AdvantageOutputs:
    """An estimator's result: `advantages` ([N] or [B, T]) and, for critic-based estimators, `returns` ([B, T])."""

    advantages: torch.Tensor
    returns: torch.Tensor | None = None


AdvantageEstimator = Callable[..., AdvantageOutputs]

_REGISTRY: dict[str, AdvantageEstimator] = {}
_SEQUENCE_LEVEL: set[str] = set()
# A live view: names registered later (by users) show up too.
ADVANTAGE_ESTIMATORS = _REGISTRY.keys()


def register_advantage_estimator(
    name: str, *, sequence_level: bool = True
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator registering ``fn(inputs: AdvantageInputs, **params) -> AdvantageOutputs`` under `name`.

    Args:
        name: The name trainers select it by (e.g. `GRPOConfig.advantage_estimator`).
        sequence_level: True when it maps [N] sequence rewards (with group ids) to [N] advantages, which is what GRPO
            can use; False for token-level estimators that need values (gae).
    """

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"An advantage estimator named {name!r} is already registered; pick another name.")
        _REGISTRY[name] = fn
        if sequence_level:
            _SEQUENCE_LEVEL.add(name)
        return fn

    return decorator


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under `name`; ValueError naming the registered ones otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"Unknown advantage estimator {name!r}; registered: {', '.join(_REGISTRY)}. Register one with "
            "`trl_stable.core.estimators.register_advantage_estimator`."
        ) from None


def is_sequence_level(name: str) -> bool:
    """Whether the registered estimator `name` maps [N] sequence rewards to [N] advantages."""
    return name in _SEQUENCE_LEVEL


def _sequence_rewards(inputs: AdvantageInputs) -> torch.Tensor:
    if inputs.rewards.dim() != 1:
        raise ValueError(f"rewards must be [N] sequence rewards here, got shape {tuple(inputs.rewards.shape)}.")
    return inputs.rewards


def _normalized(inputs: AdvantageInputs, preset: str, params: dict[str, Any]) -> AdvantageOutputs:
    settings = {**NORMALIZATION_PRESETS[preset], "unbiased": True, "eps": 1e-4, **params}
    return AdvantageOutputs(normalize(_sequence_rewards(inputs), inputs.group_ids, **settings))


@register_advantage_estimator("grpo")
def grpo_estimator(inputs: AdvantageInputs, **params: Any) -> AdvantageOutputs:
    r"""GRPO (DeepSeekMath, arXiv 2402.03300): $A_i = (r_i - \mu_{g(i)}) / (\sigma_{g(i)} + \epsilon)$.

    Group mean and unbiased group std, $\epsilon = 10^{-4}$ (TRL's). Params: those of `trl_stable.core.normalize`
    (`mean_level`, `std_level`, `leave_one_out`, `unbiased`, `eps`), overriding the preset. Needs `rewards` [N] and
    `group_ids`.
    """
    return _normalized(inputs, "grpo", params)


@register_advantage_estimator("dr_grpo")
def dr_grpo_estimator(inputs: AdvantageInputs, **params: Any) -> AdvantageOutputs:
    r"""Dr.GRPO (arXiv 2503.20783): $A_i = r_i - \mu_{g(i)}$, no std scaling (it biases towards easy prompts).

    Params as for "grpo". Needs `rewards` [N] and `group_ids`.
    """
    return _normalized(inputs, "dr_grpo", params)


@register_advantage_estimator("liteppo")
def liteppo_estimator(inputs: AdvantageInputs, **params: Any) -> AdvantageOutputs:
    r"""LitePPO ("Tricks or Traps", arXiv 2508.08221): $A_i = (r_i - \mu_{g(i)}) / (\sigma_{batch} + \epsilon)$.

    Group mean, batch std of the centered rewards. Params as for "grpo". Needs `rewards` [N] and `group_ids`.
    """
    return _normalized(inputs, "liteppo", params)


@register_advantage_estimator("rloo")
def rloo_estimator(inputs: AdvantageInputs, **params: Any) -> AdvantageOutputs:
    r"""RLOO (Ahmadian et al., arXiv 2402.14740): $A_i = r_i - \frac{1}{n_g - 1}\sum_{j \in g(i), j \ne i} r_j$.

    Leave-one-out group mean, no std. Params as for "grpo". Needs `rewards` [N] and `group_ids`.
    """
    return _normalized(inputs, "rloo", params)


@register_advantage_estimator("gdpo")
def gdpo_estimator(inputs: AdvantageInputs, eps: float = 1e-4) -> AdvantageOutputs:
    r"""GDPO (arXiv 2601.05242), `trl_stable.core.gdpo_advantages`: $A_i$ = the batch z-score of
    $\sum_j w_j z_{ij}$, the per-reward group z-scores. Needs `rewards_per_func` [N, K] and `group_ids`;
    `reward_weights` [K] (default ones).
    """
    if inputs.rewards_per_func is None:
        raise ValueError("The 'gdpo' estimator needs AdvantageInputs.rewards_per_func ([N, K], a column per reward).")
    return AdvantageOutputs(gdpo_advantages(inputs.rewards_per_func, inputs.group_ids, inputs.reward_weights, eps))


@register_advantage_estimator("ngrpo")
def ngrpo_estimator(
    inputs: AdvantageInputs, r_max: float = 1.0, num_virtual: int = 1, eps: float = 1e-6
) -> AdvantageOutputs:
    r"""NGRPO (arXiv 2509.18851), `trl_stable.core.ngrpo_advantages`: $A_i = (r_i - \mu)/(\sigma + \epsilon)$ with
    the group's $\mu$, $\sigma$ taken with `num_virtual` extra samples of reward `r_max`. Needs `rewards` [N] and
    `group_ids`.
    """
    return AdvantageOutputs(ngrpo_advantages(_sequence_rewards(inputs), inputs.group_ids, r_max, num_virtual, eps))


def _require(inputs: AdvantageInputs, name: str, *fields: str) -> None:
    missing = [f for f in fields if getattr(inputs, f) is None]
    if missing:
        raise ValueError(f"The {name!r} estimator needs AdvantageInputs.{', '.join(missing)}.")


@register_advantage_estimator("gae", sequence_level=False)
def gae_estimator(inputs: AdvantageInputs, gamma: float = 1.0, lam: float | torch.Tensor = 0.95) -> AdvantageOutputs:
    r"""GAE (Schulman et al. 2016, arXiv 1506.02438) over the active tokens: `trl_stable.core.compute_gae`.

    $\delta_k = r_{t_k} + \gamma V_{t_{k+1}} - V_{t_k}$, $A_{t_k} = \delta_k + \gamma\lambda A_{t_{k+1}}$,
    returns $= A + V$; masked positions consume no time step. Needs `rewards`, `values`, `mask` ([B, T]);
    `bootstrap` [B] optional. `lam` may be a [B] tensor (`vapo_lambda`).
    """
    _require(inputs, "gae", "values", "mask")
    advantages, returns = compute_gae(inputs.rewards, inputs.values, inputs.mask, gamma, lam, inputs.bootstrap)
    return AdvantageOutputs(advantages, returns)


@register_advantage_estimator("turn_gae", sequence_level=False)
def turn_gae_estimator(
    inputs: AdvantageInputs, gamma: float = 1.0, lam: float | torch.Tensor = 0.95
) -> AdvantageOutputs:
    r"""Turn-level GAE for multi-turn agents (each assistant turn one macro step): `trl_stable.core.compute_turn_gae`.

    $R_u$ = the turn's summed token rewards, $V_u$ = the value at its first token,
    $A_u = \delta_u + \gamma\lambda A_{u+1}$ broadcast to the turn's tokens, plus `token_rewards` per token. Needs
    `rewards`, `values`, `turn_ids` ([B, T]); `token_rewards`, `bootstrap` optional.
    """
    _require(inputs, "turn_gae", "values", "turn_ids")
    advantages, returns = compute_turn_gae(
        inputs.rewards, inputs.values, inputs.turn_ids, gamma, lam, inputs.token_rewards, inputs.bootstrap
    )
    return AdvantageOutputs(advantages, returns)
