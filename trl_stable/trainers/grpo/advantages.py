"""GRPO's advantages from trl_stable's estimator registry (`trl_stable.core.estimators`), computed over the gathered
batch in place of TRL's, and each reward's own group z-score logged."""

from __future__ import annotations

import logging
from typing import Any

import torch
from trl.trainer.utils import nanstd

from trl_stable.core import normalize
from trl_stable.core.estimators import AdvantageInputs, get_advantage_estimator
from trl_stable.rewards.dense import weighted_reward_sum
from trl_stable.trainers.grpo.trl_logs import log_metric

logger = logging.getLogger(__name__)


class SequenceAdvantages:
    """`GRPOTrainer`'s registry route for the sequence advantages."""

    def _compute_sequence_advantages(
        self, rewards_per_func: torch.Tensor, group_ids: torch.Tensor, settings: dict[str, Any]
    ) -> torch.Tensor:
        """Sequence advantages [N] over the gathered batch from the registered estimator (NaN where unscorable)."""
        params = dict(settings)
        name = params.pop("estimator")
        rewards = weighted_reward_sum(rewards_per_func, self.reward_weights)
        if name == "ngrpo":
            r_max = params["r_max"]
            top = torch.nan_to_num(rewards, nan=r_max).max().item()
            if top > r_max and not getattr(self, "_warned_ngrpo_r_max", False):
                self._warned_ngrpo_r_max = True  # once: the virtual sample must carry the best achievable reward
                logger.warning(
                    f"A reward ({top:.4g}) exceeds ngrpo_r_max={r_max}; NGRPO's virtual samples should carry the "
                    "maximum reward: set ngrpo_r_max to it or rescale the rewards."
                )
        inputs = AdvantageInputs(
            rewards,
            group_ids=group_ids,
            rewards_per_func=rewards_per_func,
            reward_weights=self.reward_weights.to(rewards_per_func.device),
        )
        advantages = get_advantage_estimator(name)(inputs, **params).advantages
        self._log_per_reward_advantages(rewards_per_func, group_ids)
        log_metric(self, "advantages/mean", torch.nanmean(advantages).item())
        log_metric(self, "advantages/std", nanstd(advantages).item())
        return advantages

    def _log_per_reward_advantages(self, rewards_per_func: torch.Tensor, group_ids: torch.Tensor) -> None:
        """Each reward's own group z-score (GDPO's per-reward advantage), to see which reward drives learning."""
        for i, name in enumerate(self.reward_func_names):
            z = normalize(rewards_per_func[:, i], group_ids, mean_level="group", std_level="group", eps=1e-4)
            log_metric(self, f"advantages/{name}/mean", torch.nanmean(z).item())
            log_metric(self, f"advantages/{name}/std", nanstd(z).item())
            log_metric(self, f"advantages/{name}/abs_mean", torch.nanmean(z.abs()).item())
