"""NGRPO's group advantages, DAPO's overlong penalty and dynamic-sampling test, and dense reward-to-go."""

from __future__ import annotations

import torch

from trl_stable.core.normalization import _group_index, _segment_sum

__all__ = ["dense_advantages", "ngrpo_advantages", "overlong_penalty", "reward_to_go", "zero_variance_groups"]


def ngrpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    r_max: float = 1.0,
    num_virtual: int = 1,
    eps: float = 1e-6,
) -> torch.Tensor:
    r"""NGRPO: group advantages with virtual maximum-reward samples (arXiv 2509.18851).

    Each group is augmented with $K$ = `num_virtual` virtual samples of reward $r_{max}$ before its mean and unbiased
    std are taken: $\mu = (\sum_i r_i + K r_{max})/(n + K)$,
    $\sigma = \sqrt{(\sum_i (r_i - \mu)^2 + K (r_{max} - \mu)^2)/(n + K - 1)}$,
    $A_i = (r_i - \mu)/(\sigma + \epsilon)$.
    An all-wrong group still gets a signal (8 zeros: every $A = -1/3$), one at $r_{max}$ keeps 0. NaN stays NaN.
    """
    if num_virtual < 1:
        raise ValueError(f"num_virtual={num_virtual} must be >= 1 (NGRPO adds at least one virtual sample).")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}.")
    valid = ~torch.isnan(rewards)
    rv = torch.where(valid, rewards, torch.zeros_like(rewards))
    index, n_groups = _group_index(rewards, group_ids, "group")
    counts = _segment_sum(valid.to(rewards.dtype), index, n_groups) + num_virtual
    mean = (_segment_sum(rv, index, n_groups) + num_virtual * r_max) / counts
    dev = torch.where(valid, rewards - mean[index], torch.zeros_like(rewards))
    ss = _segment_sum(dev**2, index, n_groups) + num_virtual * (r_max - mean) ** 2
    std = torch.where(counts > 1, torch.sqrt(ss / (counts - 1).clamp(min=1)), torch.ones_like(counts))
    return (rewards - mean[index]) / (std[index] + eps)


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, overlong_tokens: int, factor: float = 1.0
) -> torch.Tensor:
    r"""DAPO's soft overlong punishment (arXiv 2503.14476).

    $p(L) = \min\left(-\frac{L - (L_{max} - B)}{B}\cdot f,\; 0\right)$ with $B$ = `overlong_tokens`: zero up to
    $L_{max} - B$, then a linear ramp down to $-f$ at $L_{max}$. `lengths` [N] in tokens; returns [N] penalties.
    """
    if overlong_tokens <= 0 or overlong_tokens > max_length:
        raise ValueError(
            f"overlong_tokens={overlong_tokens} must be in [1, max_length={max_length}]: it is the buffer before "
            "the length limit."
        )
    lengths = lengths.to(torch.float32)
    penalty = -(lengths - (max_length - overlong_tokens)) / overlong_tokens * factor
    return torch.clamp(penalty, max=0.0)


def zero_variance_groups(rewards: torch.Tensor, group_ids: torch.Tensor, atol: float = 1e-6) -> torch.Tensor:
    r"""DAPO dynamic sampling (arXiv 2503.14476): True for every sample whose group's rewards are all equal (all right
    / all wrong), $\max_{j \in g(i)} r_j - \min_{j \in g(i)} r_j \le$ `atol`.

    NaN rewards are ignored; a group with at most one finite reward counts as zero-variance. Returns bool [N].
    """
    valid = ~torch.isnan(rewards)
    index, n_groups = _group_index(rewards, group_ids, "group")
    big = torch.finfo(rewards.dtype).max
    hi = rewards.new_full((n_groups,), -big).scatter_reduce(0, index, torch.where(valid, rewards, -big), reduce="amax")
    lo = rewards.new_full((n_groups,), big).scatter_reduce(0, index, torch.where(valid, rewards, big), reduce="amin")
    spread = torch.where(hi >= lo, hi - lo, torch.zeros_like(hi))
    return (spread <= atol)[index]


def reward_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    r"""Discounted reward-to-go (the return $G_t$ of Sutton and Barto 2018) over the active tokens of each row.

    $G_t = \sum_{s \ge t,\ m_s = 1} \gamma^{k(t, s)} r_s$, where $k(t, s)$ counts the active tokens strictly between
    $t$ and $s$ plus one for each step, so masked positions (padding, tool output) consume no time step and add no
    reward. Masked positions return 0. `rewards`, `mask` [B, T]; `gamma` in (0, 1].
    """
    maskf = mask.to(rewards.dtype)
    r = rewards * maskf
    if gamma == 1.0:
        return torch.flip(torch.cumsum(torch.flip(r, dims=[1]), dim=1), dims=[1]) * maskf
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in range(r.shape[1] - 1, -1, -1):
        active = maskf[:, t]
        running = torch.where(active > 0, r[:, t] + gamma * running, running)
        out[:, t] = running * active
    return out


def dense_advantages(
    sequence_advantages: torch.Tensor,
    dense_rewards: torch.Tensor,
    mask: torch.Tensor,
    coef: float = 1.0,
    gamma: float = 1.0,
) -> torch.Tensor:
    r"""Token advantages from a sequence advantage plus dense (per-token) rewards.

    $A_{i,t} = A_i + c \cdot G_{i,t}$ with $A_i$ the group-normalized sequence advantage and $G_{i,t}$ the
    `reward_to_go` of the dense rewards (Drlc / RELC, arXiv 2401.07382, moved from PPO's GAE into group baselines).
    `sequence_advantages` [B] or [B, 1]; `dense_rewards`, `mask` [B, T]; masked positions are 0.
    """
    seq = sequence_advantages.reshape(-1, 1).to(dense_rewards.dtype)
    return (seq + coef * reward_to_go(dense_rewards, mask, gamma)) * mask.to(dense_rewards.dtype)
