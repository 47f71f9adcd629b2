"""Policy-loss pieces: the clipped PPO term, the decoupled (behaviour-weighted) term and its normalisation.
`fold_behaviour_weight` adds the decoupled loss to TRL's loss through its advantages; `decoupled_ppo_loss` is the
reference it is tested against.
"""

from __future__ import annotations

import torch

from trl_stable.core.masked_stats import masked_mean

__all__ = [
    "LOG_RATIO_BOUND",
    "decoupled_ppo_loss",
    "decoupled_ppo_term",
    "fold_behaviour_weight",
    "pre_mask_token_mean",
    "policy_clip_fraction",
    "ppo_clip_term",
]

# Bound of the log-ratio before the exp (verl's `ppo_loss` guard): exp(20) ~ 5e8 is finite in fp32 and bf16.
LOG_RATIO_BOUND = 20.0


def ppo_clip_term(
    logps: torch.Tensor,
    prox_logps: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
) -> torch.Tensor:
    r"""Per-token clipped PPO loss (Schulman et al. 2017; clip-higher from DAPO, dual clip from Ye et al. 2020).

    $r = \exp(\text{clamp}(\log\pi_\theta - \log\pi_{prox}, -20, 20))$,
    $\ell = \max(-A r,\ -A\,\text{clip}(r, 1-\epsilon_{low}, 1+\epsilon_{high}))$, and with dual clip $c > 1$,
    $\ell = \min(\ell, c|A|)$ where $A < 0$.

    `logps`, `prox_logps` [B, T], `advantages` [B, T] or [B, 1]; `eps_high` None means `eps_low`. The clamp
    (verl's guard, `LOG_RATIO_BOUND`) keeps a 20-nat drift from an inf ratio and a NaN loss; inside it nothing
    changes, beyond it the loss saturates with a 0 gradient instead of exploding.
    """
    eps_high = eps_low if eps_high is None else eps_high
    ratio = torch.exp(torch.clamp(logps - prox_logps.detach(), -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    loss = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high))
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip={dual_clip} must be > 1.")
        loss = torch.where(advantages < 0, torch.minimum(loss, dual_clip * advantages.abs()), loss)
    return loss


def decoupled_ppo_term(
    logps: torch.Tensor,
    prox_logps: torch.Tensor,
    behaviour_weights: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
) -> torch.Tensor:
    r"""Decoupled PPO term (AReaL, arXiv 2505.24298): $w \cdot \ell_{PPO}(\pi_\theta / \pi_{prox}, A)$.

    Clipped against the proximal policy; the detached $w = \pi_{prox} / \pi_{behav}$ (`behaviour_weight`) corrects
    for another engine having sampled the tokens. Per token, [B, T].
    """
    return behaviour_weights.detach() * ppo_clip_term(logps, prox_logps, advantages, eps_low, eps_high, dual_clip)


def pre_mask_token_mean(
    per_token_loss: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor | None = None
) -> torch.Tensor:
    r"""Token mean normalised by the token count *before* filtering: $\sum_t m_t k_t \ell_t / \max(\sum_t m_t, 1)$
    (AReaL's decoupled loss, arXiv 2505.24298).

    The pre-mask count keeps the step size independent of how many tokens the filter `keep` ([B, T], True keeps)
    drops; `mask` is the [B, T] completion mask.
    """
    maskf = mask.to(per_token_loss.dtype)
    kept = maskf if keep is None else maskf * keep.to(per_token_loss.dtype)
    # where, not a product: a filtered token may hold inf/NaN
    summed = torch.where(kept > 0, per_token_loss, torch.zeros_like(per_token_loss)).sum()
    return summed / maskf.sum().clamp(min=1.0)


def decoupled_ppo_loss(
    logps: torch.Tensor,
    prox_logps: torch.Tensor,
    behaviour_weights: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    keep: torch.Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
) -> torch.Tensor:
    r"""Scalar decoupled PPO loss (AReaL, arXiv 2505.24298): `pre_mask_token_mean` of `decoupled_ppo_term` and `keep`.

    $L = \frac{1}{\sum m}\sum_{t} m_t k_t\, w_t\, \ell_{PPO,t}$ with $k$ the IcePop/KPop filter.
    """
    term = decoupled_ppo_term(logps, prox_logps, behaviour_weights, advantages, eps_low, eps_high, dual_clip)
    return pre_mask_token_mean(term, mask, keep)


def fold_behaviour_weight(
    advantages: torch.Tensor, behaviour_weights: torch.Tensor, keep: torch.Tensor | None = None
) -> torch.Tensor:
    r"""Fold the behaviour weight and the token filter into (B, T) advantages: $\tilde A = A \cdot w \cdot k$ (the
    decoupled loss of AReaL, arXiv 2505.24298, through any loss linear in $A$).

    For $w \ge 0$, $w \max(-A r, -A\,\text{clip}(r)) = \max(-(wA) r, -(wA)\,\text{clip}(r))$ (likewise the dual
    clip, CISPO and GSPO): any loss linear in $A$ per token computes the decoupled term from $\tilde A$, a filtered
    token contributing 0 while counting in the normaliser. Returns [B, T] in the advantages' dtype.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    weight = behaviour_weights.detach().to(advantages.dtype)
    if keep is not None:
        weight = torch.where(keep.bool(), weight, torch.zeros_like(weight))
    return advantages * weight


def policy_clip_fraction(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip: float
) -> torch.Tensor:
    r"""Share of tokens whose gradient the ratio clip removes, PPO's ``clipfrac`` (Schulman et al. 2017, arXiv
    1707.06347): $\overline{[\,|r - 1| > \epsilon \wedge A (r - 1) > 0\,]}$ over the masked tokens, the ratio left
    $[1 - \epsilon, 1 + \epsilon]$ in the direction the advantage pushes it."""
    clipped = ((ratio - 1.0).abs() > clip) & ((advantages * (ratio - 1.0)) > 0)
    return masked_mean(clipped.float(), mask)
