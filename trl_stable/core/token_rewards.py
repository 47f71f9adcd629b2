r"""PPO's per-token reward: the KL penalty on every action token, dense rewards, the score on the last one.

Pure torch. Ziegler et al. 2019 (arXiv 1909.08593) for $r_t = -\beta\, KL_t + \text{score}\cdot[t = \text{last}]$;
Cao et al. 2024 (RELC / Drlc, arXiv 2401.07382) for the dense term $d_t$.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trl_stable.core.masked_stats import Reduce, masked_moments

__all__ = ["TokenRewards", "compose_token_rewards", "last_action_index"]


def last_action_index(mask: torch.Tensor) -> torch.Tensor:
    r"""[B] index $\max\{t : m_t = 1\}$ of the last action token of each row (0 for an empty row): where the
    sequence score goes (Ziegler et al. 2019)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.zeros_like(positions)).max(1).values


@dataclass
class TokenRewards:
    """PPO's per-token reward [B, T], ``kl_part`` ($-\beta KL_t$) + ``env_part`` (dense rewards and the score),
    apart for turn-level GAE."""

    rewards: torch.Tensor
    kl_part: torch.Tensor
    env_part: torch.Tensor


def compose_token_rewards(
    kl: torch.Tensor,
    kl_coef: float,
    dense: torch.Tensor,
    scores: torch.Tensor | None,
    mask: torch.Tensor,
    whiten: bool = False,
    reduce_sum: Reduce | None = None,
) -> TokenRewards:
    r"""$r_t = -\beta\, KL_t + d_t + s\cdot[t = \text{last action}]$ on the masked tokens.

    With `whiten`, the total is mapped by $x \mapsto (x - \mu)/\sigma + \mu$ (old TRL's reward whitening); the KL part
    takes the $1/\sigma$ and the environment part the shift, so the two still add up to the whitened total.
    `kl`, `dense`, `mask` [B, T]; `scores` [B] or None.
    """
    kl_part = -kl_coef * kl * mask
    env_part = dense.clone()
    if scores is not None:
        rows = torch.arange(mask.shape[0], device=mask.device)
        env_part[rows, last_action_index(mask)] += scores.to(env_part.dtype)
    env_part = env_part * mask
    if whiten:
        mean, std = masked_moments(kl_part + env_part, mask, reduce_sum)
        kl_part = kl_part / std * mask
        env_part = ((env_part - mean) / std + mean) * mask
    return TokenRewards(kl_part + env_part, kl_part, env_part)
