"""PPO's clipped value loss (the critic's objective).

Pure torch. The clip of the value prediction around the rollout's value follows OpenAI's PPO2 baseline, as discussed by
Engstrom et al. 2020, "Implementation Matters in Deep Policy Gradients" (arXiv 2005.12729), and Huang et al. 2024,
"The N+ Implementation Details of RLHF with PPO" (arXiv 2403.17031).
"""

from __future__ import annotations

import torch

from trl_stable.core.masked_stats import masked_mean

__all__ = ["clipped_value_loss"]


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
