"""What the policy loss weighs its tokens by besides the advantages (a `PPOTrainer` mixin): the step mask
(`step_loss_mask`) and the decoupled loss's behavior weights with the IcePop / KPop keep mask."""

from __future__ import annotations

import torch

from trl_stable.core.behaviour_weights import behaviour_weight, filter_behaviour_weight
from trl_stable.monitoring.mismatch import behaviour_filter_metrics, mismatch_stats
from trl_stable.monitoring.reduction import step_mask_stats


class LossWeights:
    """`PPOTrainer`'s loss weights; reads `args`, `accelerator`, `processing_class` and `step_masker`."""

    def _apply_step_keep(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """With a step masker: `step_keep` [B, R] into `batch` (invalid agent steps 0) and its metrics (`Stat`s)."""
        if self.step_masker is None:
            return {}
        batch["step_keep"] = self.step_masker.keep_mask(
            batch["response_ids"], batch["response_mask"], self.processing_class
        )
        return step_mask_stats(self.step_masker.stats())  # this process's counts, reduced in step()

    def _behaviour_weights(self, batch: dict[str, torch.Tensor], sampler_logprobs) -> dict[str, float]:
        """Behaviour weight w = exp(logp_rollout_pass - logp_sampler) and the IcePop/KPop keep mask, into `batch`."""
        args = self.args
        prox, mask = batch["old_logprobs"], batch["response_mask"]
        behav = torch.zeros_like(prox)
        for i, row in enumerate(sampler_logprobs):
            behav[i, : len(row)] = torch.as_tensor(row, dtype=torch.float32).to(behav.device)
        # a sampler that gave no log-prob for a token (vLLM's None) leaves it uncorrected: weight 1, not NaN
        behav = torch.where(torch.isnan(behav), prox, behav)
        lower, upper = args.filter_bounds
        raw = behaviour_weight(prox, behav, mask)
        weight, keep = filter_behaviour_weight(
            prox, behav, mask, args.token_filter, args.token_filter_action, lower, upper, args.token_filter_level
        )
        batch["behaviour_weight"] = weight
        batch["behaviour_keep"] = mask.bool() if keep is None else keep
        gather = self.accelerator.gather
        return {
            **behaviour_filter_metrics(mask, raw, weight, keep, args.token_filter, gather=gather),
            # |diff| mean/max, ratio spread and sequence perplexity ratio over all processes' tokens
            **mismatch_stats(behav, prox, mask, gather=gather).as_metrics(),
        }
