"""Per-token KL estimators against a reference policy (Schulman, "Approximating KL Divergence", 2020: k1, k2, k3,
as verl's ``kl_penalty`` names them) and PPO's KL-coefficient controllers (Ziegler et al. 2019, arXiv 1909.08593).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "FULL_KL",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLEstimator",
    "full_kl",
    "kl_abs",
    "kl_estimate",
    "kl_estimator_names",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_low_var",
    "register_kl_estimator",
]

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# The registry: what `PPOConfig.kl_penalty` accepts (with "full") and what `kl_estimate` computes.
KL_ESTIMATORS: dict[str, KLEstimator] = {}
# The exact KL over the vocabulary: it needs both models' logits, not two log-probs, so the trainer computes it itself
# with `full_kl` and it cannot be a registry entry.
FULL_KL = "full"


def register_kl_estimator(name: str) -> Callable[[KLEstimator], KLEstimator]:
    """Decorator registering ``f(logp, ref_logp) -> kl`` ([B, T], per token) under `name` for
    `PPOConfig(kl_penalty=name)`; register it before building the config, on every process."""

    def wrap(func: KLEstimator) -> KLEstimator:
        if name == FULL_KL:
            raise ValueError(f"{FULL_KL!r} is the exact KL over the vocabulary (`full_kl`); use another name.")
        if name in KL_ESTIMATORS and KL_ESTIMATORS[name] is not func:
            raise ValueError(f"A KL estimator named {name!r} is already registered; pick another name.")
        KL_ESTIMATORS[name] = func
        return func

    return wrap


def kl_estimator_names() -> tuple[str, ...]:
    """Every valid `kl_penalty`: the registered estimators, then "full"."""
    return (*KL_ESTIMATORS, FULL_KL)


@register_kl_estimator("kl")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    r"""k1 (Schulman 2020): $\log\pi(a) - \log\pi_{ref}(a)$. Unbiased for KL(pi || ref) under samples of pi; high
    variance, can be negative."""
    return logp - ref_logp


@register_kl_estimator("abs")
def kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    r"""$|\log\pi(a) - \log\pi_{ref}(a)|$: non-negative, biased (old TRL's and verl's ``abs``)."""
    return (logp - ref_logp).abs()


@register_kl_estimator("mse")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    r"""k2 (Schulman 2020): $\frac{1}{2}(\log\pi(a) - \log\pi_{ref}(a))^2$: non-negative, low variance, biased."""
    return 0.5 * (logp - ref_logp).square()


@register_kl_estimator("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    r"""k3 (Schulman 2020): $e^{\log\pi_{ref} - \log\pi} - (\log\pi_{ref} - \log\pi) - 1$: unbiased for
    KL(pi || ref) and >= 0."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1.0


@register_kl_estimator("low_var_kl")
def kl_low_var(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    r"""verl's ``low_var_kl``: k3 with the log-ratio clamped to [-20, 20] and the result to [-10, 10], so one token
    whose reference log-prob collapsed cannot dominate the penalty (verl, ``core_algos.kl_penalty``)."""
    log_ratio = (ref_logp - logp).clamp(-20.0, 20.0)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor, chunk_size: int = 128) -> torch.Tensor:
    r"""Exact $KL(\pi \| \pi_{ref}) = \sum_v \pi(v) (\log\pi(v) - \log\pi_{ref}(v))$ per position, over the vocabulary
    (old TRL's ``kl_penalty="full"``).

    `logits`, `ref_logits` [B, T, V] (divided by the temperature), `chunk_size` positions at a time in fp32.
    """
    flat, ref_flat = logits.reshape(-1, logits.shape[-1]), ref_logits.reshape(-1, ref_logits.shape[-1])
    out = []
    for rows, ref_rows in zip(flat.split(chunk_size), ref_flat.split(chunk_size)):
        logp = torch.log_softmax(rows.float(), dim=-1)
        ref_logp = torch.log_softmax(ref_rows.float(), dim=-1)
        out.append((logp.exp() * (logp - ref_logp)).sum(-1))
    return torch.cat(out).reshape(logits.shape[:-1]) if out else logits.new_zeros(logits.shape[:-1]).float()


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """The per-token KL estimate `kind`, one of `KL_ESTIMATORS` ("full" needs the logits: use `full_kl`)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(
            f"Unknown KL estimator {kind!r}; use one of {', '.join(KL_ESTIMATORS)} (with the logits: {FULL_KL!r}, "
            "`full_kl`), or register one with `trl_stable.core.register_kl_estimator`."
        )
    return KL_ESTIMATORS[kind](logp, ref_logp)


class AdaptiveKLController:
    r"""Adaptive KL coefficient (Ziegler et al. 2019, arXiv 1909.08593):

    $e = \mathrm{clip}(KL / target - 1, -0.2, 0.2)$,    $\beta \leftarrow \beta (1 + e \cdot n / horizon)$

    with $n$ the number of samples of the step (all processes).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value, self.target, self.horizon = float(init_kl_coef), float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


class FixedKLController:
    r"""Constant KL coefficient $\beta$ (Ziegler et al. 2019, arXiv 1909.08593, without the adaptation)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass
