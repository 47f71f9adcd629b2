r"""Advantage estimators behind one registry and one signature (verl's `core_algos.py` pattern):
``fn(inputs: AdvantageInputs, **params) -> AdvantageOutputs``, the batch in `AdvantageInputs`, hyper-parameters as
keywords.
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
    """What an advantage estimator may read (each estimator names the fields it needs): `rewards` [N] (sequence) or
    [B, T] (gae, turn_gae); `group_ids` [N] (None: one group); `rewards_per_func` [N, K], NaN where a function does not
    apply, and `reward_weights` [K] (gdpo); `mask`, `values`, `turn_ids`, `token_rewards` [B, T] and `bootstrap` [B]
    (gae, turn_gae)."""

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
    """Decorator registering ``fn(inputs: AdvantageInputs, **params) -> AdvantageOutputs`` under `name`;
    `sequence_level` when it maps [N] sequence rewards to [N] advantages (what GRPO can use), False for gae."""

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
    if name not in _REGISTRY:
        raise ValueError(
            f"Unknown advantage estimator {name!r}; registered: {', '.join(_REGISTRY)}. Register one with "
            "`trl_stable.core.estimators.register_advantage_estimator`."
        )
    return _REGISTRY[name]


def is_sequence_level(name: str) -> bool:
    """Whether the registered estimator `name` maps [N] sequence rewards to [N] advantages."""
    return name in _SEQUENCE_LEVEL


def _sequence_rewards(inputs: AdvantageInputs) -> torch.Tensor:
    if inputs.rewards.dim() != 1:
        raise ValueError(f"rewards must be [N] sequence rewards here, got shape {tuple(inputs.rewards.shape)}.")
    return inputs.rewards


def _require(inputs: AdvantageInputs, name: str, *fields: str) -> None:
    missing = [f for f in fields if getattr(inputs, f) is None]
    if missing:
        raise ValueError(f"The {name!r} estimator needs AdvantageInputs.{', '.join(missing)}.")


def _normalized(inputs: AdvantageInputs, preset: str, params: dict[str, Any]) -> AdvantageOutputs:
    settings = {**NORMALIZATION_PRESETS[preset], "unbiased": True, "eps": 1e-4, **params}
    return AdvantageOutputs(normalize(_sequence_rewards(inputs), inputs.group_ids, **settings))


@register_advantage_estimator("grpo")
def grpo_estimator(inputs: AdvantageInputs, **params: Any) -> AdvantageOutputs:
    r"""GRPO (DeepSeekMath, arXiv 2402.03300): $A_i = (r_i - \mu_{g(i)}) / (\sigma_{g(i)} + \epsilon)$, unbiased
    std, $\epsilon = 10^{-4}$. Params: `normalize`'s, overriding the preset. Needs `rewards` [N] and `group_ids`."""
    return _normalized(inputs, "grpo", params)


@register_advantage_estimator("dr_grpo")
def dr_grpo_estimator(inputs: AdvantageInputs, **params: Any) -> AdvantageOutputs:
    r"""Dr.GRPO (arXiv 2503.20783): $A_i = r_i - \mu_{g(i)}$, no std scaling. As "grpo"."""
    return _normalized(inputs, "dr_grpo", params)


@register_advantage_estimator("liteppo")
def liteppo_estimator(inputs: AdvantageInputs, **params: Any) -> AdvantageOutputs:
    r"""LitePPO (arXiv 2508.08221): $A_i = (r_i - \mu_{g(i)}) / (\sigma_{batch} + \epsilon)$, the batch std of the
    centered rewards. As "grpo"."""
    return _normalized(inputs, "liteppo", params)


@register_advantage_estimator("rloo")
def rloo_estimator(inputs: AdvantageInputs, **params: Any) -> AdvantageOutputs:
    r"""RLOO (Ahmadian et al., arXiv 2402.14740): $A_i = r_i - \frac{1}{n_g - 1}\sum_{j \in g(i), j \ne i} r_j$.
    As "grpo"."""
    return _normalized(inputs, "rloo", params)


@register_advantage_estimator("gdpo")
def gdpo_estimator(inputs: AdvantageInputs, eps: float = 1e-4) -> AdvantageOutputs:
    r"""GDPO (arXiv 2601.05242), `gdpo_advantages`: $A_i$ = the batch z-score of $\sum_j w_j z_{ij}$, the
    per-reward group z-scores. Needs `rewards_per_func` [N, K] and `group_ids`."""
    _require(inputs, "gdpo", "rewards_per_func")
    return AdvantageOutputs(gdpo_advantages(inputs.rewards_per_func, inputs.group_ids, inputs.reward_weights, eps))


@register_advantage_estimator("ngrpo")
def ngrpo_estimator(
    inputs: AdvantageInputs, r_max: float = 1.0, num_virtual: int = 1, eps: float = 1e-6
) -> AdvantageOutputs:
    r"""NGRPO (arXiv 2509.18851), `ngrpo_advantages`: $A_i = (r_i - \mu)/(\sigma + \epsilon)$, the group's
    $\mu$, $\sigma$ with `num_virtual` extra samples of reward `r_max`. Needs `rewards` [N] and `group_ids`."""
    return AdvantageOutputs(ngrpo_advantages(_sequence_rewards(inputs), inputs.group_ids, r_max, num_virtual, eps))


@register_advantage_estimator("gae", sequence_level=False)
def gae_estimator(inputs: AdvantageInputs, gamma: float = 1.0, lam: float | torch.Tensor = 0.95) -> AdvantageOutputs:
    r"""GAE (Schulman et al. 2016, arXiv 1506.02438), `compute_gae`: $\delta_k = r_{t_k} + \gamma V_{t_{k+1}} -
    V_{t_k}$, $A_{t_k} = \delta_k + \gamma\lambda A_{t_{k+1}}$, returns $= A + V$. Needs `rewards`, `values`,
    `mask`; `lam` may be [B]."""
    _require(inputs, "gae", "values", "mask")
    advantages, returns = compute_gae(inputs.rewards, inputs.values, inputs.mask, gamma, lam, inputs.bootstrap)
    return AdvantageOutputs(advantages, returns)


@register_advantage_estimator("turn_gae", sequence_level=False)
def turn_gae_estimator(
    inputs: AdvantageInputs, gamma: float = 1.0, lam: float | torch.Tensor = 0.95
) -> AdvantageOutputs:
    r"""Turn-level GAE (`compute_turn_gae`): $A_u = \delta_u + \gamma\lambda A_{u+1}$ over the turns' summed
    rewards $R_u$ and first-token values $V_u$, broadcast to the turn's tokens. Needs `rewards`, `values`,
    `turn_ids`."""
    _require(inputs, "turn_gae", "values", "turn_ids")
    advantages, returns = compute_turn_gae(
        inputs.rewards, inputs.values, inputs.turn_ids, gamma, lam, inputs.token_rewards, inputs.bootstrap
    )
    return AdvantageOutputs(advantages, returns)
