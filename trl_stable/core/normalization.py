"""Reward and advantage normalization: `normalize` for the mean/std family (GRPO, Dr.GRPO, LitePPO, RLOO), and
GDPO's per-reward form."""

from __future__ import annotations

import math

import torch

from trl_stable.core.masked_stats import Reduce

__all__ = ["NORMALIZATION_LEVELS", "NORMALIZATION_PRESETS", "gdpo_advantages", "gdpo_scores", "normalize"]

NORMALIZATION_LEVELS = ("batch", "group", None)

# The combinations that have papers (TRL's single-stage form).
NORMALIZATION_PRESETS: dict[str, dict[str, object]] = {
    "grpo": {"mean_level": "group", "std_level": "group", "leave_one_out": False},  # DeepSeekMath, arXiv 2402.03300
    "dr_grpo": {"mean_level": "group", "std_level": None, "leave_one_out": False},  # Dr.GRPO, arXiv 2503.20783
    "liteppo": {"mean_level": "group", "std_level": "batch", "leave_one_out": False},  # LitePPO, arXiv 2508.08221
    "rloo": {"mean_level": "group", "std_level": None, "leave_one_out": True},  # RLOO, arXiv 2402.14740
}


def _group_index(values: torch.Tensor, group_ids: torch.Tensor | None, level: str) -> tuple[torch.Tensor, int]:
    """Dense group index in [0, n_groups) for each value; the batch level is one group."""
    if level == "batch" or group_ids is None:
        return torch.zeros(values.shape[0], dtype=torch.long, device=values.device), 1
    if group_ids.shape != values.shape:
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)} but values has {tuple(values.shape)}.")
    _, inverse = torch.unique(group_ids.to(values.device), return_inverse=True)
    return inverse, int(inverse.max().item()) + 1 if inverse.numel() else 0


def _segment_sum(x: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Sums of the rows of `x` ([N, ...]) by group: [n, ...]."""
    return torch.zeros((n, *x.shape[1:]), dtype=x.dtype, device=x.device).index_add_(0, index, x)


def normalize(
    values: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    *,
    mean_level: str | None = "batch",
    std_level: str | None = "batch",
    leave_one_out: bool = False,
    unbiased: bool = True,
    eps: float = 1e-5,
) -> torch.Tensor:
    r"""Center and scale `values` by batch- or group-level statistics.

    With $S$ the set a statistic is taken over (all values for "batch", the value's group for "group"):

    - mean: $\mu_i = \frac{1}{|S|}\sum_{j \in S} x_j$; with `leave_one_out`,
      $\mu_i = \frac{1}{|S| - 1}\sum_{j \in S, j \ne i} x_j$ (0 when $|S| \le 1$); level None: $\mu_i = 0$.
    - std around the chosen mean: $\sigma_i = \sqrt{\sum_{j \in S}(x_j - \mu_j)^2 / (|S| - 1)}$ (unbiased) or
      $/|S|$ (biased); 1 when $|S| \le 1$; level None: $\sigma = 1$ and `eps` = 0.
    - out $= (x - \mu) / (\sigma + \epsilon)$.

    `values` [N], `group_ids` [N] (None: one group; sizes may differ). NaN entries are missing: in no statistic, NaN
    in the output. GRPO (arXiv 2402.03300), Dr.GRPO (2503.20783), LitePPO (2508.08221), RLOO (2402.14740); the
    parametrisation is AReaL's NormConfig.
    """
    if values.dim() != 1:
        raise ValueError(f"values must be 1-D [N], got shape {tuple(values.shape)}.")
    for name, level in (("mean_level", mean_level), ("std_level", std_level)):
        if level not in NORMALIZATION_LEVELS:
            raise ValueError(f"{name}={level!r} is invalid; use 'batch', 'group' or None.")
    if leave_one_out and mean_level is None:
        raise ValueError("leave_one_out=True needs a mean: set mean_level='group' (RLOO) or 'batch'.")

    valid = ~torch.isnan(values)
    xv = torch.where(valid, values, torch.zeros_like(values))
    validf = valid.to(values.dtype)

    if mean_level is None:
        mean = torch.zeros_like(values)
    else:
        index, n_groups = _group_index(values, group_ids, mean_level)
        sums = _segment_sum(xv, index, n_groups)[index]
        counts = _segment_sum(validf, index, n_groups)[index]
        if leave_one_out:
            denom = counts - 1
            mean = torch.where(denom > 0, (sums - xv) / denom.clamp(min=1), torch.zeros_like(values))
        else:
            mean = sums / counts.clamp(min=1)

    centered = values - mean
    if std_level is None:
        return centered

    index, n_groups = _group_index(values, group_ids, std_level)
    ss = _segment_sum(torch.where(valid, centered, torch.zeros_like(values)) ** 2, index, n_groups)[index]
    counts = _segment_sum(validf, index, n_groups)[index]
    denom = counts - 1 if unbiased else counts
    std = torch.where(counts > 1, torch.sqrt(ss / denom.clamp(min=1)), torch.ones_like(values))
    return centered / (std + eps)


def gdpo_scores(
    rewards: torch.Tensor,
    weights: torch.Tensor | list[float] | None = None,
    eps: float = 1e-4,
    reduce_sum: Reduce | None = None,
    group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""GDPO's per-reward normalization and weighted sum (arXiv 2601.05242), before its final batch z-score.

    For reward $j$ and group $g$, with $V_{gj}$ the samples of $g$ that reward $j$ applies to (not NaN) and
    $n_{gj} = |V_{gj}|$:

    $\mu_{gj} = \frac{1}{n_{gj}}\sum_{i \in V_{gj}} r_{ij}$,
    $\sigma_{gj} = \sqrt{\sum_{i \in V_{gj}} (r_{ij} - \mu_{gj})^2 / (n_{gj} - 1)}$ (1 when $n_{gj} \le 1$),
    $z_{ij} = (r_{ij} - \mu_{g(i)j}) / (\sigma_{g(i)j} + \epsilon)$, and the score
    $s_i = \sum_{j:\, r_{ij} \ne \text{NaN}} w_j z_{ij}$ (NaN when no reward applies to sample $i$).

    So a high-variance reward cannot drown the others. `gdpo_advantages` z-scores $s$ over the batch; PPO uses $s$
    with `group_ids` None (one group: every process's batch, summed by `reduce_sum`). `rewards` [N, K], `weights` [K]
    (None: ones). Sums in float64, two passes: $E[x^2] - E[x]^2$ loses a small spread of large scores.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N, K], got shape {tuple(rewards.shape)}.")
    if reduce_sum is not None and group_ids is not None:
        raise ValueError(
            "gdpo_scores takes reduce_sum only with group_ids=None (one group, the batch of every process); gather "
            "the rewards of every process and pass their group ids instead."
        )
    num_rewards = rewards.shape[1]
    weights = torch.ones(num_rewards) if weights is None else torch.as_tensor(weights)
    weights = weights.to(dtype=rewards.dtype, device=rewards.device)
    if weights.shape != (num_rewards,):
        raise ValueError(
            f"weights has {weights.numel()} entries but rewards has {num_rewards} columns; give one weight per "
            "reward function."
        )
    reduce_sum = reduce_sum or (lambda t: t)
    index, n_groups = _group_index(rewards.new_empty(rewards.shape[0]), group_ids, "group")
    valid = ~torch.isnan(rewards)
    x = torch.where(valid, rewards, torch.zeros_like(rewards)).double()
    sums = reduce_sum(torch.stack([_segment_sum(x, index, n_groups), _segment_sum(valid.double(), index, n_groups)]))
    count = sums[1]
    centered = torch.where(valid, x - (sums[0] / count.clamp(min=1))[index], torch.zeros_like(x))
    squares = reduce_sum(_segment_sum(centered**2, index, n_groups))
    std = torch.where(count > 1, (squares / (count - 1).clamp(min=1)).sqrt(), torch.ones_like(count))
    # a reward constant within its group has std 0: with eps = 0 that is 0/0, and its z is 0, not NaN
    z = torch.where(centered == 0, torch.zeros_like(centered), centered / (std[index] + eps))
    scores = (z * weights.double()).sum(1).to(rewards.dtype)
    return torch.where(valid.any(1), scores, torch.full_like(scores, math.nan))


def gdpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    weights: torch.Tensor | list[float] | None = None,
    eps: float = 1e-4,
) -> torch.Tensor:
    r"""GDPO (arXiv 2601.05242): $A_i = (s_i - \mu_s)/(\sigma_s + \epsilon)$ over the batch, with $s$ the per-reward
    group z-scores summed by weight (`gdpo_scores`, whose NaN rules apply); TRL's
    ``multi_objective_aggregation="normalize_then_sum"``. Arguments as for `gdpo_scores`."""
    summed = gdpo_scores(rewards, weights, eps, group_ids=group_ids)
    return normalize(summed, mean_level="batch", std_level="batch", eps=eps)
