"""Behaviour weights and token filters for the decoupled loss (docs/decoupled_loss.md): IcePop (ratio band) and KPop
(binary KL). `prox_logps` are the trainer's log-probs at the rollout weights, `behav_logps` the sampler's, `mask` the
completion loss mask ([B, T] each); filters return bool, True = keep, False where `mask` is 0. A non-finite log-ratio
carries no evidence and counts as 0 (weight 1); KPop clamps probabilities instead (-inf is 1e-8).
"""

from __future__ import annotations

import torch

__all__ = [
    "behaviour_log_ratio",
    "behaviour_weight",
    "binary_kl",
    "clamp_behaviour_weight",
    "filter_behaviour_weight",
    "icepop_mask",
    "kpop_mask",
]


def behaviour_log_ratio(prox_logps: torch.Tensor, behav_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""$\log w = \log\pi_{prox} - \log\pi_{behav}$ (AReaL's decoupled PPO, arXiv 2505.24298) in fp32, detached;
    non-finite and masked positions give 0."""
    log_ratio = prox_logps.detach().float() - behav_logps.detach().float()
    return torch.where(mask.bool() & torch.isfinite(log_ratio), log_ratio, torch.zeros_like(log_ratio))


def behaviour_weight(prox_logps: torch.Tensor, behav_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""Decoupled-PPO behaviour weight $w = \exp(\log\pi_{prox} - \log\pi_{behav})$ (AReaL, arXiv 2505.24298).

    Detached fp32; non-finite log-ratios are set to 0 (w = 1) so one broken token cannot blow up the loss, and
    masked positions are 1. Shape [B, T].
    """
    return torch.exp(behaviour_log_ratio(prox_logps, behav_logps, mask))


def _log_band(lower: float, upper: float, what: str) -> tuple[float, float]:
    """(log lower, log upper) of an IcePop band, after checking 0 < lower < upper."""
    if not (0 < lower < upper):
        raise ValueError(f"{what} needs 0 < lower < upper, got lower={lower}, upper={upper}.")
    return torch.log(torch.tensor(lower)).item(), torch.log(torch.tensor(upper)).item()


def _at_level(x: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """`x` per token [B, T], or at level "sequence" its masked mean per sequence [B, 1], which the token tests
    broadcast to keep or drop the whole sequence."""
    if level == "token":
        return x
    if level != "sequence":
        raise ValueError(f"level={level!r} is invalid; use 'token' or 'sequence'.")
    summed = torch.where(mask.bool(), x, torch.zeros_like(x)).sum(dim=1, keepdim=True)
    return summed / mask.float().sum(dim=1, keepdim=True).clamp(min=1.0)


def icepop_mask(
    prox_logps: torch.Tensor,
    behav_logps: torch.Tensor,
    mask: torch.Tensor,
    lower: float = 0.5,
    upper: float = 5.0,
    level: str = "token",
) -> torch.Tensor:
    r"""IcePop (Ring-1T, arXiv 2510.18855): keep a token iff $\text{lower} \le w \le \text{upper}$ (inclusive,
    0 < lower < upper), with $w$ as in `behaviour_weight`.

    At `level` "sequence" the sequence weight is the geometric mean $w_{seq} = \exp(\text{mean}_t \log w_t)$ over the
    masked tokens, and the whole sequence is kept or dropped.
    """
    lo, hi = _log_band(lower, upper, "IcePop")
    log_ratio = _at_level(behaviour_log_ratio(prox_logps, behav_logps, mask), mask, level)
    return (log_ratio >= lo) & (log_ratio <= hi) & mask.bool()


def binary_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r"""KL between Bernoulli(p) and Bernoulli(q): $p\log\frac{p}{q} + (1-p)\log\frac{1-p}{1-q}$ (no clamping); KPop's
    divergence (AReaL, arXiv 2505.24298)."""
    return p * (torch.log(p) - torch.log(q)) + (1 - p) * (torch.log1p(-p) - torch.log1p(-q))


def kpop_mask(
    prox_logps: torch.Tensor,
    behav_logps: torch.Tensor,
    mask: torch.Tensor,
    upper: float = 2.0,
    level: str = "token",
) -> torch.Tensor:
    r"""KPop: keep a token iff the symmetric binary KL of its probabilities is at most `upper` (AReaL).

    $p = \text{clamp}(e^{\log\pi_{prox}}, 10^{-8}, 1 - 10^{-8})$, $q$ likewise from $\log\pi_{behav}$;
    keep iff $\max(KL_B(p\|q), KL_B(q\|p)) \le \text{upper}$. A token's probability is treated as a coin, so the
    test sees both a collapse and an explosion of the probability, unlike a ratio band. At level "sequence" the
    per-token maximum KL is averaged over the masked tokens and the whole sequence is kept or dropped. `upper` > 0.
    """
    if not upper > 0:
        raise ValueError(f"KPop needs upper > 0, got upper={upper}.")
    # fp64: 1 - 1e-8 rounds to 1.0 in fp32, and log1p(-1) would turn a certain token into NaN
    prox = prox_logps.detach().double()
    behav = behav_logps.detach().double()
    p = torch.exp(prox).clamp(1e-8, 1 - 1e-8)
    q = torch.exp(behav).clamp(1e-8, 1 - 1e-8)
    kl = torch.maximum(binary_kl(p, q), binary_kl(q, p))
    # A NaN log-prob carries no evidence (see the module docstring): count it as agreement.
    kl = torch.where(torch.isnan(prox) | torch.isnan(behav), torch.zeros_like(kl), kl)
    return (_at_level(kl, mask, level) <= upper) & mask.bool()


def clamp_behaviour_weight(
    prox_logps: torch.Tensor,
    behav_logps: torch.Tensor,
    mask: torch.Tensor,
    lower: float = 0.5,
    upper: float = 5.0,
    level: str = "token",
) -> torch.Tensor:
    r"""IcePop's "clamp" action (Ring-1T, arXiv 2510.18855): a behaviour weight bounded to the band instead of dropping
    tokens.

    Token level: $\tilde w_t = \text{clamp}(w_t, \text{lower}, \text{upper})$ with $w_t$ as in `behaviour_weight`
    (a non-finite log-ratio counts as 0). Sequence level: the tokens of a sequence are rescaled so that their geometric
    mean is clamped, $\tilde w_t = w_t \cdot \text{clamp}(w_{seq}, l, u) / w_{seq}$. Masked positions are 1.
    """
    lo, hi = _log_band(lower, upper, "IcePop clamp")
    log_ratio = behaviour_log_ratio(prox_logps, behav_logps, mask)
    if level == "token":
        out = torch.exp(log_ratio.clamp(lo, hi))
    else:
        seq = _at_level(log_ratio, mask, level)
        out = torch.exp(log_ratio + (seq.clamp(lo, hi) - seq))
    return torch.where(mask.bool(), out, torch.ones_like(out))


def filter_behaviour_weight(
    prox_logps: torch.Tensor,
    behav_logps: torch.Tensor,
    mask: torch.Tensor,
    kind: str | None,
    action: str = "mask",
    lower: float | None = None,
    upper: float | None = None,
    level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""The decoupled loss's behaviour weight after the token filter `kind` (None, "icepop" or "kpop").

    Returns `(weight, keep)`: `weight` is `behaviour_weight` $w$, or for IcePop with action "clamp" the
    `clamp_behaviour_weight` $\text{clamp}(w, \text{lower}, \text{upper})$; `keep` is `icepop_mask` (keep iff
    lower <= w <= upper, Ring-1T arXiv 2510.18855) or `kpop_mask` (keep iff the symmetric binary KL <= upper, AReaL
    arXiv 2505.24298), and None when nothing is masked (no filter, or clamp). KPop has no lower bound.
    """
    weight = behaviour_weight(prox_logps, behav_logps, mask)
    if kind is None:
        return weight, None
    if kind == "icepop" and action == "clamp":
        return clamp_behaviour_weight(prox_logps, behav_logps, mask, lower, upper, level), None
    if kind == "icepop":
        return weight, icepop_mask(prox_logps, behav_logps, mask, lower, upper, level)
    if kind == "kpop":
        return weight, kpop_mask(prox_logps, behav_logps, mask, upper, level)
    raise ValueError(f"kind={kind!r} is unknown; use 'icepop', 'kpop' or None.")
