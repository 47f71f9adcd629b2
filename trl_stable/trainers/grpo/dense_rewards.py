"""Dense (per-token) reward functions in GRPO (`trl_stable.rewards.dense`): kept out of TRL's reward functions,
prefetched when TRL scores, collected after its scoring round and added to the advantages as a reward-to-go."""

from __future__ import annotations

from typing import Any

import torch

from trl_stable.core import dense_advantages
from trl_stable.integration.reward_calls import call_reward_func
from trl_stable.monitoring.reduction import dense_reward_stats, reduce_metrics
from trl_stable.rewards.dense import (
    PendingDenseRewards,
    is_dense_reward,
    start_dense_rewards,
    weighted_reward_sum,
)
from trl_stable.trainers.grpo.trl_batch import loss_mask, process_slice
from trl_stable.trainers.grpo.trl_logs import flush_reward_logs, log_metrics
from trl_stable.trainers.grpo.trl_rewards import reward_kwargs
from trl_stable.trainers.processes import call_on_every_process, guard_reward_failures


class DenseRewards:
    """`GRPOTrainer`'s dense reward functions (``dense_reward_funcs``, split from TRL's ``reward_funcs``)."""

    def _split_dense_reward_funcs(self) -> None:
        dense = [i for i, func in enumerate(self.reward_funcs) if is_dense_reward(func)]
        keep = [i for i in range(len(self.reward_funcs)) if i not in dense]
        if dense and not keep:
            raise ValueError(
                "Every reward function is dense: GRPO needs at least one sequence-level reward function for the "
                "group baseline; add one to reward_funcs (the dense rewards are added on top)."
            )
        self.dense_reward_funcs = [self.reward_funcs[i] for i in dense]
        self.dense_reward_func_names = [self.reward_func_names[i] for i in dense]
        self.dense_reward_weights = self.reward_weights[dense].clone()
        self.reward_funcs = [self.reward_funcs[i] for i in keep]
        self.reward_func_names = [self.reward_func_names[i] for i in keep]
        self.reward_processing_classes = [self.reward_processing_classes[i] for i in keep]
        self.reward_weights = self.reward_weights[keep].clone()

    def _start_dense_rewards(self, inputs, prompts, completions, completion_ids_list, rewards_per_func):
        """Prefetch the dense reward functions; returns their pending call (collected by `_collect_dense_rewards`)."""
        user = rewards_per_func[process_slice(self.accelerator, len(prompts)), : self._num_user_reward_funcs]
        kwargs = reward_kwargs(self, inputs)
        kwargs.update(prompts=prompts, completions=completions, completion_ids=completion_ids_list)
        kwargs["env_rewards"] = weighted_reward_sum(user, self.reward_weights[: self._num_user_reward_funcs]).tolist()
        loop = getattr(self, "async_loop", None)
        return start_dense_rewards(
            self.dense_reward_funcs,
            self.dense_reward_func_names,
            self.dense_reward_weights.tolist(),
            [len(ids) for ids in completion_ids_list],
            call=lambda func, **extra: call_reward_func(func, loop, **kwargs, **extra),
            prefetch=lambda func: call_reward_func(func.prefetch, loop, **kwargs),  # the call's own arguments
            limit=self._opt("max_abs_reward"),
        )

    def _collect_dense_rewards(self, pending: PendingDenseRewards) -> torch.Tensor:
        """Call the prefetched dense reward functions on every process together (a contract error on one stops all;
        what they logged is flushed with this step); their weighted sum [B, T_max] on the local completions."""
        dense = call_on_every_process(self.accelerator, pending.collect)
        flush_reward_logs(self, len(pending.completion_lengths))
        if self.model.training:  # a dense function that raised on any process failed this step
            guard_reward_failures(
                self.accelerator, self.reward_guards, pending.names, None, dense.failures, everywhere=False
            )
        # token means over every process's tokens, counts summed: the numbers of one process with the global batch
        stats = dense_reward_stats(dense.metrics, pending.completion_lengths)
        log_metrics(self, reduce_metrics(stats, self.accelerator))
        return dense.as_tensor(device=self.accelerator.device)

    def _add_dense_advantages(self, output: dict[str, Any], dense: torch.Tensor) -> torch.Tensor:
        """The batch's advantages plus the dense rewards' [B, T] reward-to-go (`trl_stable.core.dense_advantages`)."""
        width = output["completion_ids"].size(1)
        dense = torch.nn.functional.pad(dense, (0, width - dense.size(1)))[:, :width]
        return dense_advantages(
            output["advantages"],
            dense.to(output["completion_mask"].device),
            loss_mask(output),
            coef=self._opt("dense_reward_coef"),
            gamma=self._opt("dense_reward_gamma"),
        )
