"""Tables of completions (a `PPOTrainer` mixin): `train()`'s `completions` table and old TRL's `log_stats` game log,
gathered from every process and logged as TRL's GRPO logs its table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from accelerate.utils import gather_object

from trl_stable.trainers.ppo.evaluation import completion_rewards


class Tables:
    """`PPOTrainer`'s tables; `self.tables` holds the latest table per name (main process)."""

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
