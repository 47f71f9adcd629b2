"""GRPO's decoupled PPO loss (AReaL): the proximal log-probs, one extra no-grad forward at the rollout weights, and
the behavior weight and token filter (IcePop / KPop) folded into (B, T) advantages that TRL's `_compute_loss` takes
unchanged ([Decoupled loss, IcePop and KPop](docs/decoupled_loss.md))."""

from __future__ import annotations

from typing import Any

import torch
from trl.models.utils import disable_gradient_checkpointing

from trl_stable.core import behaviour_weight, filter_behaviour_weight, fold_behaviour_weight
from trl_stable.moe.hook import ROUTED_EXPERTS_KEY
from trl_stable.monitoring.mismatch import behaviour_filter_metrics
from trl_stable.trainers.grpo.trl_batch import forward_kwargs, loss_mask
from trl_stable.trainers.grpo.trl_logs import log_metrics, train_mode


class DecoupledLoss:
    """`GRPOTrainer`'s decoupled-loss steps, run on the final batch of each generation batch."""

    @torch.no_grad()
    def _compute_proximal_logps(self, output: dict[str, Any]) -> torch.Tensor:
        """Proximal log-probs: the policy at the rollout weights, one extra no-grad forward (a rollout pass for
        routing replay: R3 replays the sampler's routing, R2 records this pass's)."""
        mode = train_mode(self)
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        sampled = output.get(ROUTED_EXPERTS_KEY) if self.routing.mode == "R3" else None
        with (
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
            self.routing.rollout_pass(attention_mask, sampled) as rollout,
        ):
            logps, _, _ = self._get_per_token_logps_and_entropies(
                self.model,
                input_ids,
                attention_mask,
                output["completion_ids"].size(1),
                batch_size=batch_size,
                **forward_kwargs(output),
            )
        if self.routing.mode == "R2":
            output[ROUTED_EXPERTS_KEY] = rollout.routing
        elif sampled is not None:
            self._log_routing("routing/rollout_")
        return logps

    def _apply_decoupled_loss(self, output: dict[str, Any]) -> None:
        """Fold the behaviour weight and the token filter into (B, T) advantages (see `fold_behaviour_weight`).

        With sequence-level importance sampling (GSPO) a masking filter also leaves TRL's loss mask, so the filtered
        tokens do not enter the sequence log-ratio, which TRL averages over that mask (as AReaL averages it over the
        kept tokens). `num_items_in_batch` keeps the pre-filter count, so the dapo/cispo/dr_grpo normalisers stay the
        pre-mask count; TRL's "grpo"/"bnpo" normalisers read the mask itself and count the kept tokens only.
        """
        behav = output.get("sampling_per_token_logps")
        if behav is None:
            raise RuntimeError(
                "use_decoupled_loss=True needs the sampler's per-token log-probs, but the batch has none; a "
                "rollout_func must return 'logprobs' for its completions."
            )
        prox = output.get("old_per_token_logps")
        if prox is None:
            prox = self._compute_proximal_logps(output)
            output["old_per_token_logps"] = prox
        mask = loss_mask(output)
        raw_weight = behaviour_weight(prox, behav, mask)
        name = self._opt("token_filter")
        lower, upper = self.args.filter_bounds if name else (None, None)
        weight, keep = filter_behaviour_weight(
            prox, behav, mask, name, self._opt("token_filter_action"), lower, upper, self._opt("token_filter_level")
        )
        output["advantages"] = fold_behaviour_weight(output["advantages"], weight, keep)
        if keep is not None and self.importance_sampling_level == "sequence":
            self._apply_loss_mask(output, keep, renormalize=False)
        metrics = behaviour_filter_metrics(mask, raw_weight, weight, keep, name, gather=self.accelerator.gather)
        log_metrics(self, metrics)
