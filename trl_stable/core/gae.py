"""Generalised advantage estimation over tokens and turns (Schulman et al. 2016, arXiv 1506.02438), and lambda
schedules per sequence (VAPO, arXiv 2504.05118; AReaL, arXiv 2505.24298).
"""

from __future__ import annotations

import torch

__all__ = ["compute_gae", "compute_turn_gae", "count_turns", "relative_position_lambda", "vapo_lambda"]


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 0.95,
    bootstrap: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Token-level GAE where masked positions consume no time step.

    Over the active (mask = 1) positions t_1 < t_2 < ... < t_n of each sequence, with V_{t_{n+1}} = bootstrap:

        delta_k = r_{t_k} + gamma * V_{t_{k+1}} - V_{t_k}
        A_{t_k} = delta_k + gamma * lam * A_{t_{k+1}},        A_{t_{n+1}} = 0
        returns = A + V

    so padding or prompt tokens in between are skipped, not zero-reward steps (Schulman et al. 2016, arXiv
    1506.02438). `rewards`, `values`, `mask` [B, T]; `lam` a float or [B]; `bootstrap` [B] (None: 0). Returns
    (advantages, returns) [B, T], 0 where masked.
    """
    if rewards.shape != values.shape or rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"rewards, values and mask must all be [B, T]; got {tuple(rewards.shape)}, {tuple(values.shape)}, "
            f"{tuple(mask.shape)}."
        )
    rewards, values = rewards.float(), values.float()
    active = mask.bool()
    batch, length = rewards.shape
    lam_col = torch.as_tensor(lam, device=rewards.device, dtype=rewards.dtype)  # a scalar broadcasts over the batch
    if lam_col.dim() != 0 and lam_col.shape != (batch,):
        raise ValueError(f"lam must be a float or a [B] tensor with B={batch}, got shape {tuple(lam_col.shape)}.")
    next_value = torch.zeros(batch, device=rewards.device) if bootstrap is None else bootstrap.float().clone()
    next_adv = torch.zeros(batch, device=rewards.device)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        m = active[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam_col * next_adv
        advantages[:, t] = torch.where(m, adv, torch.zeros_like(adv))
        next_adv = torch.where(m, adv, next_adv)
        next_value = torch.where(m, values[:, t], next_value)
    return advantages, (advantages + values) * active


def compute_turn_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    turn_ids: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 0.95,
    token_rewards: torch.Tensor | None = None,
    bootstrap: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Turn-level GAE for multi-turn agents: each assistant turn is one macro step (AReaL, arXiv 2505.24298).

    For turn u of a sequence (the tokens whose `turn_ids` equal u): R_u = sum of its token `rewards`, V_u = the
    value at its first token. Then GAE runs over the turns present (`compute_gae` on [B, U]):

        delta_u = R_u + gamma * V_{u+1} - V_u,    A_u = delta_u + gamma * lam * A_{u+1}

    A_u and the return A_u + V_u are broadcast to the turn's tokens; `token_rewards` ([B, T], e.g. the KL penalty)
    are added per token outside the recursion. `turn_ids` [B, T]: non-decreasing turn indices of assistant tokens,
    -1 elsewhere (no action). Returns (advantages, returns) [B, T], 0 where `turn_ids` is -1.
    """
    if rewards.shape != values.shape or rewards.shape != turn_ids.shape or rewards.dim() != 2:
        raise ValueError("rewards, values and turn_ids must all be [B, T].")
    active = turn_ids >= 0
    running_max = torch.where(active, turn_ids, -1).cummax(dim=1).values
    if bool((active & (turn_ids < running_max)).any()):
        raise ValueError("turn_ids must be non-decreasing along each sequence (ignoring -1 positions).")
    batch, length = rewards.shape
    num_turns = int(turn_ids.max().item()) + 1 if bool(active.any()) else 0
    if num_turns == 0:
        zeros = torch.zeros(batch, length, device=rewards.device)
        return zeros, zeros.clone()
    ids = turn_ids.clamp(min=0)
    turn_rewards = torch.zeros(batch, num_turns, device=rewards.device).scatter_add_(1, ids, rewards.float() * active)
    # first token of each turn: the smallest position carrying that id (`length` for a turn the row lacks)
    positions = torch.arange(length, device=rewards.device).expand(batch, length)
    first = torch.full((batch, num_turns), length, device=rewards.device, dtype=torch.long)
    first.scatter_reduce_(1, ids, torch.where(active, positions, length), reduce="amin")
    present = first < length
    turn_values = values.float().gather(1, first.clamp(max=length - 1)) * present
    turn_adv, turn_ret = compute_gae(turn_rewards, turn_values, present, gamma, lam, bootstrap)
    advantages = torch.where(active, turn_adv.gather(1, ids), 0.0)
    returns = torch.where(active, turn_ret.gather(1, ids), 0.0)
    if token_rewards is not None:
        advantages = advantages + token_rewards.float() * active
    return advantages, returns


def count_turns(turn_ids: torch.Tensor) -> torch.Tensor:
    """[B] number of distinct turns (ids >= 0) per row: the effective length L of turn-level GAE, the number of steps
    its recursion runs over, which a lambda schedule must see (AReaL counts turns in turn mode, not tokens)."""
    active = turn_ids >= 0
    # carry the last active id over inactive positions, so a turn interrupted by tool output is counted once
    seen = torch.where(active, turn_ids, torch.full_like(turn_ids, -1)).cummax(dim=1).values
    previous_seen = torch.cat([torch.full_like(seen[:, :1], -1), seen[:, :-1]], dim=1)
    return (active & (turn_ids != previous_seen)).sum(dim=1)


def vapo_lambda(lengths: torch.Tensor, alpha: float = 0.05) -> torch.Tensor:
    r"""VAPO's length-adaptive GAE lambda (Yue et al. 2025, arXiv 2504.05118): lam = max(0, 1 - 1 / (alpha * L)).

    Longer sequences get a lambda closer to 1 so the sum of the TD weights, 1 / (1 - lam) = alpha * L, grows with L.
    L = 0 gives 0.
    """
    lengths = lengths.float()
    lam = 1.0 - 1.0 / (alpha * lengths.clamp(min=1e-12))
    return torch.where(lengths > 0, lam.clamp(min=0.0), torch.zeros_like(lengths))


def relative_position_lambda(lengths: torch.Tensor, q: float = 0.5) -> torch.Tensor:
    r"""Relative-position GAE lambda (AReaL, arXiv 2505.24298): lam = q^(1/(L-1)) for L >= 2, 1 for L = 1, 0 for L = 0.

    Then lam^(L-1) = q: the last token's TD error reaches the first token with weight q whatever the length L, so
    credit spreads over the same relative span of long and short responses.
    """
    lengths = lengths.float()
    lam = torch.pow(torch.full_like(lengths, float(q)), 1.0 / (lengths - 1).clamp(min=1.0))
    lam = torch.where(lengths == 1, torch.ones_like(lengths), lam)
    return torch.where(lengths <= 0, torch.zeros_like(lengths), lam)
