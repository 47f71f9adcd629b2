"""Running moments of PPO's sequence scores and old TRL's score scaling (``use_score_scaling``, ``use_score_norm``).

Pure torch. The running statistics merge batch by batch with the parallel update of Chan, Golub and LeVeque 1979,
"Updating Formulae and a Pairwise Algorithm for Computing Sample Variances"; normalising the reward to a fixed scale
before the KL penalty is added follows Ziegler et al. 2019 (arXiv 1909.08593).
"""

from __future__ import annotations

import math

import torch

__all__ = ["RunningMoments", "scale_scores"]


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
