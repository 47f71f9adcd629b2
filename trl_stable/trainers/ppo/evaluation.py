"""PPO's evaluation and tables of completions (a `PPOTrainer` mixin): `evaluate` generates a completion for every
eval prompt and scores it with the reward functions, as TRL's GRPO evaluates (no training step); `train()`'s
`completions` table and old TRL's `log_stats` game log are gathered from every process and logged as TRL's GRPO logs
its table."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object
from transformers.trainer_utils import speed_metrics

from trl_stable.monitoring.reduction import reduce_metrics
from trl_stable.trainers.processes import call_on_every_process


def dense_sums(rows: Sequence[Any]) -> torch.Tensor:
    """Each completion's summed dense reward (NaN tokens count 0, as in `step`)."""
    return torch.tensor(
        [0.0 if row is None else float(torch.as_tensor(row, dtype=torch.float64).nansum()) for row in rows]
    )


def completion_rewards(rewards: Any) -> torch.Tensor:
    """Each completion's reward: its weighted sequence score (NaN where none applies) plus its dense sum."""
    if rewards.dense is None:
        return rewards.scores.float()
    dense = dense_sums(rewards.dense.rows)
    return dense if rewards.scores is None else rewards.scores.float() + dense


class Evaluation:
    """`PPOTrainer.evaluate` and its tables; reads `rewards`, `generate` and `_prompt_ids`; `self.tables` holds the
    latest table per name (main process)."""

    def evaluate(
        self, eval_dataset: Any | None = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Generate a completion for every prompt of `eval_dataset` (default `self.eval_dataset`; a dict: per name,
        prefixed ``{metric_key_prefix}_{name}``) and score it with the reward functions; returns and logs the means
        over every process's completions (docs/ppo.md, "Evaluation"). `ignore_keys` is not used."""
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        if dataset is None:
            raise ValueError("evaluate() needs an eval_dataset (PPOTrainer(eval_dataset=...) or the argument).")
        if isinstance(dataset, dict):
            metrics = {}
            for name, part in dataset.items():
                metrics.update(self.evaluate(part, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        if not len(self.rewards):
            raise ValueError("evaluate() needs reward_funcs to score the completions.")
        self._memory_tracker.start()
        self.optimizer.eval()  # a schedule-free optimizer's evaluation weights, as Trainer's evaluate uses
        start = time.time()
        columns: dict[str, list[torch.Tensor]] = {}
        batch_metrics: dict[str, list[float]] = {}
        for rows in self.get_eval_dataloader(dataset):
            prompts, queries = self._prompt_ids(rows, name="eval_dataset")
            responses = self.generate(queries, return_prompt=False)
            result = call_on_every_process(self.accelerator, self.rewards, rows, prompts, responses, self.state)
            lengths = torch.tensor([float(len(r)) for r in responses])
            per_sample = {"reward": completion_rewards(result), "completions/mean_length": lengths}
            per_sample.update({f"rewards/{name}/mean": values for name, values in result.per_func.items()})
            if result.dense is not None:
                per_sample["dense/reward_mean"] = dense_sums(result.dense.rows)
            for key, values in per_sample.items():
                # without the padding accelerate adds to the last batch
                gathered = self.accelerator.gather_for_metrics(values.float().to(self.accelerator.device))
                columns.setdefault(key, []).append(gathered.cpu())
            for key, value in reduce_metrics(result.stats, self.accelerator, names_may_differ=True).items():
                if key.startswith("critic/"):
                    batch_metrics.setdefault(key, []).append(float(value))
        metrics = {}
        for key, parts in columns.items():
            values = torch.cat(parts)
            finite = values[torch.isfinite(values)]
            metrics[f"{metric_key_prefix}_{key}"] = finite.mean().item() if len(finite) else float("nan")
        for key, values in batch_metrics.items():
            metrics[f"{metric_key_prefix}_{key}"] = float(np.mean(values))
        num_samples = len(torch.cat(columns["reward"])) if columns else 0
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=num_samples))
        self.optimizer.train()
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        self._memory_tracker.stop_and_update_metrics(metrics)
        return metrics

    def log_table(self, name: str, columns: dict[str, list[Any]]) -> None:
        """Log a table (equal-length columns, gathered from every process) as TRL's GRPO logs `completions`: on the
        main process, to the wandb / trackio run `report_to` names, and kept in `self.tables[name]`."""
        if not self.accelerator.is_main_process:
            return
        self.tables[name] = {"step": [self.state.global_step] * len(next(iter(columns.values()), [])), **columns}
        report_to = self.args.report_to or []
        backends = []
        if "wandb" in report_to:
            import wandb

            if wandb.run is not None:
                backends.append(wandb)
        if "trackio" in report_to:
            import trackio

            backends.append(trackio)
        if backends:
            import pandas as pd

            frame = pd.DataFrame(self.tables[name])
            for backend in backends:
                backend.log({name: backend.Table(dataframe=frame)})

    def _log_completions(self, prompts: list[Any], responses: list[torch.Tensor], rewards: Any) -> None:
        """The `completions` table of a logged `train()` step: prompt, completion and reward from every process."""
        completions = self.processing_class.batch_decode([r.tolist() for r in responses], skip_special_tokens=True)
        self.log_table(
            "completions",
            {
                "prompt": gather_object([p if isinstance(p, str) else str(p) for p in prompts]),
                "completion": gather_object(completions),
                "reward": gather_object(completion_rewards(rewards).tolist()),  # as `evaluate` averages it
            },
        )

    def log_stats(
        self,
        stats: dict[str, float],
        batch: dict | None = None,
        rewards: Any | None = None,
        columns_to_log: Sequence[str] = ("query", "response"),
    ) -> None:
        """Old TRL's `log_stats` (`step()` already logged `stats`): env/reward_mean and env/reward_std of every
        process's `rewards`, and the game log table of `columns_to_log` and rewards. Call it on every process."""
        if rewards is None:
            return
        local = [float(torch.as_tensor(r, dtype=torch.float32).sum()) if r is not None else math.nan for r in rewards]
        values = torch.tensor(gather_object(local), dtype=torch.float32)
        finite = values[~torch.isnan(values)]
        self.log(
            {
                "env/reward_mean": finite.mean().item() if len(finite) else math.nan,
                "env/reward_std": finite.std().item() if len(finite) > 1 else 0.0,
            }
        )
        if batch is not None:
            columns = {c: gather_object([str(v) for v in batch[c]]) for c in columns_to_log if c in batch}
            self.log_table("game_log", {**columns, "reward": values.tolist()})
