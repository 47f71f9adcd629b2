"""PPO's per-token reward, whitening and value loss (the parts of PPO that GRPO does not share).

Pure torch. References: Ziegler et al. 2019 (arXiv 1909.08593) for the per-token reward
$r_t = -\\beta\\, KL_t + \\text{score}\\cdot[t = \\text{last}]$; Stiennon et al. 2020 (arXiv 2009.01325) and
Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO" (arXiv 2403.17031) for whitening and the clipped
value loss; Cao et al. 2024 (RELC / Drlc, arXiv 2401.07382) for the dense term.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "RunningMoments",
    "TokenRewards",
    "clipped_value_loss",
    "compose_token_rewards",
    "gdpo_scores",
    "last_action_index",
    "masked_mean",
    "masked_moments",
    "masked_whiten",
    "policy_clip_fraction",
    "scale_scores",
]

Reduce = Callable[[torch.Tensor], torch.Tensor]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    r"""$\sum x m / \max(\sum m, 1)$."""
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def masked_moments(x: torch.Tensor, mask: torch.Tensor, reduce_sum: Reduce | None = None) -> tuple[torch.Tensor, ...]:
    r"""Masked mean and $\sqrt{\mathrm{var}_{unbiased} + 10^{-8}}$ of `x`, in float64 sums.

    `reduce_sum` sums a tensor over processes (``accelerator.reduce(t, "sum")``), so the moments are those of every
    process's tokens together; None for one process.
    """
    stats = torch.stack([(x * mask).sum(), (x * x * mask).sum(), mask.sum()]).double()
    if reduce_sum is not None:
        stats = reduce_sum(stats)
    count = stats[2]
    mean = stats[0] / count.clamp(min=1)
    var = (stats[1] / count.clamp(min=1) - mean**2).clamp(min=0)
    if count > 1:
        var = var * count / (count - 1)
    return mean.float(), torch.sqrt(var.float() + 1e-8)


def gdpo_scores(
    rewards: torch.Tensor,
    weights: torch.Tensor | list[float] | None = None,
    eps: float = 1e-4,
    reduce_sum: Reduce | None = None,
) -> torch.Tensor:
    r"""PPO's GDPO score: each reward normalised over the batch, then the weighted sum (arXiv 2601.05242).

    GDPO normalises every reward within its prompt group before the weighted sum; PPO samples one response per prompt,
    so its group is the whole batch (every process's samples). For reward $j$ with valid (non-NaN) samples $V_j$,
    $n_j = |V_j|$:

    $\mu_j = \frac{1}{n_j}\sum_{i \in V_j} r_{ij}$,
    $\sigma_j = \sqrt{\sum_{i \in V_j} (r_{ij} - \mu_j)^2 / (n_j - 1)}$ (1 when $n_j \le 1$),
    $z_{ij} = (r_{ij} - \mu_j) / (\sigma_j + \epsilon)$, and the score $s_i = \sum_{j: i \in V_j} w_j z_{ij}$
    (NaN when no reward applies to sample $i$).

    GDPO's final batch z-score of $s$ is left out: PPO whitens its advantages after GAE (`whiten_advantages`), and the
    score shares the per-token reward with the KL penalty, whose coefficient is set for a score of this scale. A
    reward with a large variance no longer drowns the others, and each reward's unit no longer matters.

    Args:
        rewards: [N, K] rewards, one column per reward function, NaN where a function does not apply.
        weights: [K] weights; None: all ones.
        eps: Added to every std (TRL's GDPO 1e-4).
        reduce_sum: Sums a tensor over processes (``accelerator.reduce(t, "sum")``), so the statistics are the
            global batch's; None for one process. Every process must call it.

    Returns:
        Scores [N] in the dtype of `rewards`.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N, K], got shape {tuple(rewards.shape)}.")
    num_rewards = rewards.shape[1]
    weights = torch.ones(num_rewards) if weights is None else torch.as_tensor(weights)
    weights = weights.to(dtype=rewards.dtype, device=rewards.device)
    if weights.shape != (num_rewards,):
        raise ValueError(
            f"weights has {weights.numel()} entries but rewards has {num_rewards} columns; give one weight per "
            "reward function."
        )
    reduce_sum = reduce_sum or (lambda t: t)
    valid = ~torch.isnan(rewards)
    x = torch.where(valid, rewards, torch.zeros_like(rewards)).double()
    # two passes (mean, then squared deviations) rather than sum of squares: scores of 1e4 with a spread of 1e-2
    # lose every digit of the variance in E[x^2] - E[x]^2
    sums = reduce_sum(torch.stack([x.sum(0), valid.double().sum(0)]))
    count = sums[1]
    mean = sums[0] / count.clamp(min=1)
    squares = reduce_sum(torch.where(valid, (x - mean) ** 2, torch.zeros_like(x)).sum(0))
    std = torch.where(count > 1, (squares / (count - 1).clamp(min=1)).sqrt(), torch.ones_like(count))
    z = torch.where(valid, (x - mean) / (std + eps), torch.zeros_like(x))
    scores = (z * weights.double()).sum(1).to(rewards.dtype)
    return torch.where(valid.any(1), scores, torch.full_like(scores, math.nan))


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, reduce_sum: Reduce | None = None
) -> torch.Tensor:
    r"""$(x - \mu) / \sigma$ over the masked tokens (`masked_moments`); `shift_mean=False` adds $\mu$ back (old TRL's
    ``whiten(shift_mean=False)``, used for rewards). Masked positions are 0."""
    mean, std = masked_moments(x, mask, reduce_sum)
    out = (x - mean) / std
    if not shift_mean:
        out = out + mean
    return out * mask


def last_action_index(mask: torch.Tensor) -> torch.Tensor:
    """[B] index of the last position with mask 1 in each row (0 for an empty row)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.zeros_like(positions)).max(1).values


@dataclass
class TokenRewards:
    """PPO's per-token reward split into the parts turn-level GAE keeps apart.

    Attributes:
        rewards: [B, T] total, ``kl_part + env_part``.
        kl_part: [B, T] the KL penalty $-\\beta KL_t$ (after whitening, when asked).
        env_part: [B, T] dense rewards plus the score on the last action token.
    """

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

    Args:
        kl: [B, T] per-token KL estimate.
        kl_coef: $\beta$.
        dense: [B, T] dense (per-token) rewards, 0 where there are none.
        scores: [B] sequence scores or None.
        mask: [B, T] 1 on action tokens.
    """
    kl_part = -kl_coef * kl * mask
    env_part = dense.clone()
    if scores is not None:
        rows = torch.arange(mask.shape[0], device=mask.device)
        env_part[rows, last_action_index(mask)] += scores.to(env_part.dtype)
    env_part = env_part * mask
    total = kl_part + env_part
    if whiten:
        mean, std = masked_moments(total, mask, reduce_sum)
        kl_part = kl_part / std * mask
        env_part = ((env_part - mean) / std + mean) * mask
        total = kl_part + env_part
    return TokenRewards(total, kl_part, env_part)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""PPO's clipped value loss and the share of tokens where the clipped branch is larger:

    $L_V = \frac{1}{2}\,\overline{\max\big((V - R)^2,\ (\mathrm{clip}(V, V_{old} \pm \epsilon_V) - R)^2\big)}$

    (mean over the masked tokens).
    """
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    loss1, loss2 = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * masked_mean(torch.max(loss1, loss2), mask), masked_mean((loss2 > loss1).float(), mask)


def policy_clip_fraction(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip: float
) -> torch.Tensor:
    """Share of tokens whose gradient the ratio clip removes: the ratio left ``[1 - clip, 1 + clip]`` in the
    direction the advantage pushes it."""
    clipped = ((ratio - 1.0).abs() > clip) & ((advantages * (ratio - 1.0)) > 0)
    return masked_mean(clipped.float(), mask)


class RunningMoments:
    r"""Running mean and (unbiased) std of a stream of scores, merged batch by batch (Chan et al. parallel update):

    $\delta = \mu_b - \mu$, $n' = n + n_b$, $\mu' = \mu + \delta n_b / n'$,
    $M_2' = M_2 + M_{2,b} + \delta^2 n n_b / n'$, $\sigma' = \sqrt{M_2' / (n' - 1)}$

    The std stays 1 until two scores have been seen (a zero std would blow the first scaled score up).
    """

    def __init__(self):
        self.mean, self.std, self.var, self.count = 0.0, 1.0, 0.0, 0.0

    def update(self, xs: torch.Tensor) -> tuple[float, float]:
        """Merge `xs` (1-D) into the statistics; returns the batch mean and std."""
        xs = xs.double()
        xs_count = xs.numel()
        if xs_count == 0:
            return float("nan"), float("nan")
        xs_mean = xs.mean().item()
        xs_var = xs.var(unbiased=False).item() if xs_count > 1 else 0.0
        delta = xs_mean - self.mean
        total = self.count + xs_count
        m2 = self.var * self.count + xs_var * xs_count + delta**2 * self.count * xs_count / total
        self.mean += delta * xs_count / total
        self.var = m2 / total
        self.std = math.sqrt(m2 / (total - 1)) if total > 1 else 1.0
        self.count = total
        return xs_mean, math.sqrt(xs_var * xs_count / max(xs_count - 1, 1))

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "std": self.std, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.std, self.var, self.count = state["mean"], state["std"], state["var"], state["count"]


def scale_scores(
    scores: torch.Tensor,
    running: RunningMoments | None,
    normalize: bool = False,
    clip: float | None = None,
) -> torch.Tensor:
    r"""Old TRL's score options: divide by the running std (`running`, already updated with this batch), subtract
    the running mean first with `normalize`, then clip to $[-clip, clip]$.

    A constant score stream has std 0: scaling it would multiply scores by ~1e8, so it is left unscaled.
    """
    if running is not None:
        factor = running.std + 1e-8 if running.std > 1e-6 else 1.0
        scores = (scores - running.mean) / factor if normalize else scores / factor
    if clip is not None:
        scores = scores.clamp(-clip, clip)
    return scores
