"""DAPO's fixed-size dynamic sampling in GRPO: the refill rounds that replace the rows of dropped zero-variance
groups."""

from __future__ import annotations

from typing import Any

import torch

from trl_stable.monitoring.reduction import Stat, reduce_metrics
from trl_stable.trainers.grpo.trl_batch import (
    concat_rows,
    forward_kwargs,
    num_items_in_batch,
    num_rows,
    select_rows,
    tokenizer_of,
)
from trl_stable.trainers.grpo.trl_logs import log_metric, log_metrics


class DynamicSamplingRefill:
    """`GRPOTrainer`'s refill rounds (``dynamic_sampling_max_refills``)."""

    def _refill_prompts(self, num_rows: int) -> list[dict[str, Any]]:
        """`num_rows` rows for one extra generation round: random prompts, each repeated num_generations times."""
        if not hasattr(self.train_dataset, "__getitem__") or not hasattr(self.train_dataset, "__len__"):
            raise ValueError(
                "dynamic_sampling_max_refills needs a map-style train_dataset to draw new prompts from; set "
                "dynamic_sampling_max_refills=0 for an IterableDataset."
            )
        if not hasattr(self, "_refill_generator"):
            # its own stream, so the refills neither repeat the main sampler's order nor move it
            self._refill_generator = torch.Generator().manual_seed(self.args.seed + 1 + self.accelerator.process_index)
        num_prompts = num_rows // self.num_generations
        indices = torch.randint(len(self.train_dataset), (num_prompts,), generator=self._refill_generator).tolist()
        return [dict(self.train_dataset[i]) for i in indices for _ in range(self.num_generations)]

    def _refill_dynamic_sampling(self, output: dict[str, Any], keep: torch.Tensor, num_inputs: int) -> dict[str, Any]:
        """Replace dropped rows by informative ones from extra rounds (each a full generation + scoring of new
        prompts) until every process has `num_inputs` kept rows or the refills run out (then dropped, masked rows
        top the batch up); every process runs the same rounds."""
        if forward_kwargs(output):
            raise ValueError("dynamic_sampling_max_refills does not support multimodal batches; set it to 0.")
        num_kept = int(keep.sum().item())

        def anyone_short() -> bool:
            # Decided on every process's count, so all take the same branch: a refill round is full of collectives
            # (generation, reward gathers), and a process that skipped it alone would leave the others waiting.
            shortfall = torch.tensor([float(num_inputs - num_kept)], device=self.accelerator.device)
            return self.accelerator.gather(shortfall).max().item() > 0

        if not anyone_short():
            return output
        kept = [select_rows(output, keep)]
        spare = [select_rows(output, ~keep)]
        rows_per_round = -(-num_inputs // self.num_generations) * self.num_generations
        rounds = 0
        while rounds < self._opt("dynamic_sampling_max_refills") and (rounds == 0 or anyone_short()):
            more, more_keep = self._generate_and_score_round(self._refill_prompts(rows_per_round))
            kept.append(select_rows(more, more_keep))
            spare.append(select_rows(more, ~more_keep))
            num_kept += int(more_keep.sum().item())
            rounds += 1
        log_metric(self, "dynamic_sampling/refill_rounds", rounds)
        filled = Stat.ratio(min(num_kept, num_inputs), num_inputs)  # the share of every process's rows
        log_metrics(self, reduce_metrics({"dynamic_sampling/frac_batch_filled": filled}, self.accelerator))
        merged = concat_rows(kept + spare, tokenizer_of(self).pad_token_id)
        merged = select_rows(merged, torch.arange(num_rows(merged)) < num_inputs)
        merged["num_items_in_batch"] = num_items_in_batch(merged, self.accelerator)
        return merged
