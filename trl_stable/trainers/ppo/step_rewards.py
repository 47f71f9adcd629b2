"""What `PPOTrainer.step` puts in its batch besides the forwards (a `PPOTrainer` mixin): the rewards it is given,
samples without a usable reward dropped or zeroed (`nan_reward_action`), the scores scaled over every process
(`use_score_scaling`, `score_clip`); and what the policy loss weighs its tokens by besides the advantages, the step
mask (`step_loss_mask`) and the decoupled loss's behavior weights with the IcePop / KPop keep mask."""

from __future__ import annotations

import warnings

import torch

from trl_stable.core.behaviour_weights import behaviour_weight, filter_behaviour_weight
from trl_stable.core.score_scaling import scale_scores as scale_with_moments
from trl_stable.monitoring.mismatch import behaviour_filter_metrics, mismatch_stats
from trl_stable.monitoring.reduction import Stat, reduce_metrics, step_mask_stats
from trl_stable.rewards.dense import RewardContractError, reward_numbers
from trl_stable.trainers.processes import raise_on_every_process


class StepRewards:
    """`PPOTrainer`'s step rewards and loss weights; reads `args`, `accelerator`, `running`, `processing_class` and
    `step_masker`."""

    def _drop_broken_rewards(self, batch, token_rewards, scores) -> tuple[dict, dict[str, float]]:
        """Put the rewards in the batch (`dense` [B, R], `scores` [B] after score scaling, `valid` [B]) and take the
        samples with a NaN or infinite reward out of the action mask."""
        device = self.accelerator.device
        mask = batch["response_mask"]
        n, resp_width = mask.shape
        dense = torch.zeros(n, resp_width, device=device)
        score_t = error = None
        try:  # the reward contract's number rule (`trl_stable.rewards.dense`); None, like NaN, marks no reward
            if token_rewards is not None:
                for i, row in enumerate(token_rewards):  # lengths checked by `check_per_token`
                    values = reward_numbers(
                        row, "step()'s token_rewards", lambda t, i=i: f"token {t} of sample {i}", "a list per sample"
                    )
                    dense[i, : len(values)] = torch.tensor(values, dtype=torch.float32, device=device)
            if scores is not None:
                values = reward_numbers(scores, "step()'s scores", lambda i: f"sample {i}", "one score per sample")
                score_t = torch.tensor(values, dtype=torch.float32, device=device)
        except RewardContractError as err:
            error = err
        raise_on_every_process(error, self.accelerator)
        # NaN or a value out of range (the contract's bound, max_abs_reward; +-inf) marks a sample without a reward:
        # RELC-era loops put the score inside token_rewards, so a NaN token is a failed score rather than a token the
        # reward does not apply to (as it is for a dense reward function); an overflowing one would make the
        # advantages, value loss and gradients of the batch infinite
        bad = self._out_of_range(dense).any(1)
        if score_t is not None:
            bad |= self._out_of_range(score_t)
        drop = self.args.nan_reward_action == "drop"
        # decided on every process at once: a process that raised alone would leave the others hanging in a collective
        if drop and self.accelerator.reduce(bad.all().float(), reduction="sum").item() > 0:
            raise ValueError(
                "Every sample of the batch has a NaN or infinite reward (on some process): fix the rewards."
            )
        if bool(bad.any()) and drop:
            warnings.warn(f"Dropping {int(bad.sum())} of {n} samples with a NaN or infinite reward from the step.")
            mask = mask * (~bad).unsqueeze(1)
            if "turn_ids" in batch:
                batch["turn_ids"] = torch.where(mask.bool(), batch["turn_ids"], torch.full_like(batch["turn_ids"], -1))
        elif bool(bad.any()):
            warnings.warn(
                f"{int(bad.sum())} of {n} samples with a NaN or infinite reward: advantage 0, no value loss "
                "(nan_reward_action='zero')."
            )
        valid = ~bad
        logs = {"ppo/dropped_samples" if drop else "ppo/zeroed_samples": Stat.total(bad.sum())}
        batch["response_mask"] = mask
        # the tokens with a value target: with 'zero' an unscored sample stays in the policy loss (advantage 0) only
        batch["value_mask"] = mask * valid.unsqueeze(1)
        batch["valid"] = valid
        # where, not a product: NaN * 0 is NaN. Rewards on tool-output tokens (turn id -1) count nowhere.
        batch["dense_rewards"] = torch.where(mask.bool(), dense, torch.zeros_like(dense))
        if score_t is not None:
            raw_scores = torch.where(valid, score_t, torch.zeros_like(score_t))
            batch["scores"] = self.scale_scores(raw_scores, valid) * valid
            # over every process's valid samples: the processes may have dropped different numbers of samples
            logs["env/reward_mean"] = Stat.mean(raw_scores, valid)
            logs["env/reward_std"] = Stat.std(raw_scores, valid)
        if self.args.use_score_scaling:
            logs["env/running_mean"], logs["env/running_std"] = self.running.mean, self.running.std
        return batch, reduce_metrics(logs, self.accelerator)

    def _out_of_range(self, rewards: torch.Tensor) -> torch.Tensor:
        """Where `rewards` hold no usable reward: NaN, +-inf, or beyond +-`max_abs_reward`."""
        bad = ~torch.isfinite(rewards)
        if self.args.max_abs_reward is not None:
            bad |= rewards.abs() > self.args.max_abs_reward
        return bad

    def scale_scores(self, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """`core.scale_scores` over every process's valid scores (with `use_score_scaling`); `score_clip` last."""
        args = self.args
        running = None
        if args.use_score_scaling:
            all_scores = self.accelerator.gather(scores.to(self.accelerator.device).float())
            all_valid = self.accelerator.gather(valid.to(self.accelerator.device))
            if bool(all_valid.any()):
                self.running.update(all_scores[all_valid.bool()].cpu())
            running = self.running
        return scale_with_moments(scores, running, normalize=args.use_score_norm, clip=args.score_clip)

    def _apply_step_keep(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """With a step masker: `step_keep` [B, R] into `batch` (invalid agent steps 0) and its metrics (`Stat`s)."""
        if self.step_masker is None:
            return {}
        ids, mask = batch["response_ids"], batch["response_mask"]
        batch["step_keep"] = self.step_masker.keep_mask(ids, mask, self.processing_class)
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
        return {
            **behaviour_filter_metrics(mask, raw, weight, keep, args.token_filter, gather=self.accelerator.gather),
            # |diff| mean/max, ratio spread and sequence perplexity ratio over all processes' tokens
            **mismatch_stats(behav, prox, mask, gather=self.accelerator.gather).as_metrics(),
        }
