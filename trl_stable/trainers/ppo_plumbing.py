"""The `transformers.Trainer`-like plumbing of trl_stable's PPOTrainer: state, callbacks, logging, saving, resuming.

PPO's step does not fit `Trainer.training_step` (one rollout feeds several optimiser steps over shuffled
mini-batches, and the step API is driven by the user's loop), so `PPOTrainer` keeps its own loop and takes the parts
of `Trainer` users rely on from here: a `TrainerState` with `log_history`, `TrainerCallback`s (progress bar,
reporting integrations, the health monitor), `save_model`, and resumable checkpoints.
"""

from __future__ import annotations

import os
import random
import re
import time
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback
from transformers.integrations import get_reporting_integration_callbacks
from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    ExportableState,
    ProgressCallback,
    TrainerControl,
    TrainerState,
)

__all__ = ["PPOPlumbing"]

STATE_FILE = "ppo_state.pt"
TRAINABLE_FILE = "trainable_weights.pt"


class PPOPlumbing:
    """State, callbacks, logging and checkpoints for a trainer with its own loop.

    The trainer sets `args`, `accelerator`, `model_wrapped` (a `PolicyAndValue`, possibly DDP-wrapped),
    `processing_class`, `optimizer`, `lr_scheduler` and a `shuffle_generator`, then calls `_init_plumbing`. It
    supplies `_algorithm_state()` / `_load_algorithm_state(state)` for what its checkpoints add (e.g. the KL
    coefficient).
    """

    def _init_plumbing(self, callbacks: list[TrainerCallback] | None) -> None:
        args = self.args
        self.state = TrainerState(
            is_local_process_zero=self.accelerator.is_local_main_process,
            is_world_process_zero=self.accelerator.is_main_process,
            stateful_callbacks=[],
        )
        self.control = TrainerControl()
        default = [DefaultFlowCallback] + get_reporting_integration_callbacks(args.report_to)
        if not args.disable_tqdm:
            default.append(ProgressCallback)
        self.callback_handler = CallbackHandler(
            default + list(callbacks or []), self.model, self.processing_class, self.optimizer, self.lr_scheduler
        )
        self._train_begun = False
        self._start_time = None
        self.tables: dict[str, dict[str, list[Any]]] = {}  # latest table per name (main process), see log_table

    def unwrapped(self):
        """The `PolicyAndValue` module (policy, value head, optional value backbone) without its DDP wrapper."""
        return self.accelerator.unwrap_model(self.model_wrapped)

    # ------------------------------------------------------------------ callbacks and logging
    def add_callback(self, callback: TrainerCallback | type) -> None:
        """Add a `TrainerCallback` (class or instance)."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: TrainerCallback | type) -> TrainerCallback | None:
        """Remove a callback and return it."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: TrainerCallback | type) -> None:
        """Remove a callback."""
        self.callback_handler.remove_callback(callback)

    def log(self, logs: dict[str, float]) -> None:
        """Record `logs` in `state.log_history` and send them to the callbacks (on_log), like `Trainer.log`."""
        if self.state.epoch is not None:
            logs = {**logs, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def log_table(self, name: str, columns: dict[str, list[Any]]) -> None:
        """Log a table (equal-length columns, already gathered from every process) the way TRL's GRPO logs its
        `completions` table: on the main process, straight to the wandb / trackio run when `report_to` names one
        (tables do not fit `on_log`'s scalar dicts), and kept in `self.tables[name]` for other consumers."""
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

    def _begin(self, max_steps: int) -> None:
        self.state.max_steps = max_steps
        self.state.compute_steps(self.args, max(max_steps, 1))
        self._start_time = time.time()
        self.control = TrainerControl()  # flags left over from step()-API use must not trigger saves
        self.control = self.callback_handler.on_train_begin(self.args, self.state, self.control)
        self._train_begun = True

    def _end_step(self, logs: dict[str, float]) -> None:
        """Count the step, run on_step_end, and log `logs` when the logging strategy (or the step API) says so."""
        self.state.global_step += 1
        self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
        # outside train() there is no max_steps: honour logging_steps here
        step_api = self.state.max_steps <= 0
        if self.control.should_log or (
            step_api and self.state.global_step % max(int(self.state.logging_steps), 1) == 0
        ):
            self.log(logs)
            self.control.should_log = False

    # ------------------------------------------------------------------ saving and resuming
    def save_model(self, output_dir: str | None = None) -> None:
        """Save the policy (`save_pretrained`: full model or LoRA adapter), its tokenizer, and the value head
        (`value_head.safetensors`, or the separate value model under `value_model/`)."""
        output_dir = output_dir or self.args.output_dir
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            self._write_model(output_dir)
        self.accelerator.wait_for_everyone()

    def _write_model(self, output_dir: str) -> None:
        """Write what `save_model` saves, from this process alone: no collective, so it may run under
        ``if accelerator.is_main_process:`` (DDP keeps a full copy of the weights on every process)."""
        unwrapped = self.unwrapped()
        os.makedirs(output_dir, exist_ok=True)
        unwrapped.policy.save_pretrained(output_dir)
        self.processing_class.save_pretrained(output_dir)
        unwrapped.value_head.save_pretrained(output_dir)
        if unwrapped.value_backbone is not None:
            unwrapped.value_backbone.save_pretrained(os.path.join(output_dir, "value_model"))

    def _latest_checkpoint(self) -> str:
        out = self.args.output_dir
        found = [d for d in os.listdir(out) if re.fullmatch(r"checkpoint-\d+", d)] if os.path.isdir(out) else []
        if not found:
            raise ValueError(f"resume_from_checkpoint=True but {out} holds no checkpoint-N directory.")
        return os.path.join(out, max(found, key=lambda d: int(d.split("-")[1])))

    def save_checkpoint(self, output_dir: str | None = None) -> str:
        """Save a resumable checkpoint (weights, optimizer, scheduler, the algorithm's state, RNG, trainer state);
        returns its directory (default `output_dir/checkpoint-{global_step}`)."""
        output_dir = output_dir or os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        self.save_model(output_dir)
        if self.accelerator.is_main_process:
            unwrapped = self.unwrapped()
            trainable = {n for n, p in unwrapped.named_parameters() if p.requires_grad}
            weights = {k: v.detach().cpu() for k, v in unwrapped.state_dict().items() if k in trainable}
            torch.save(weights, os.path.join(output_dir, TRAINABLE_FILE))
            torch.save(self.optimizer.state_dict(), os.path.join(output_dir, "optimizer.pt"))
            if self.lr_scheduler is not None:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))
            torch.save(self._algorithm_state(), os.path.join(output_dir, STATE_FILE))
            self.state.stateful_callbacks = {
                type(cb).__name__: cb.state()
                for cb in self.callback_handler.callbacks
                if isinstance(cb, ExportableState)
            }
            self.state.save_to_json(os.path.join(output_dir, "trainer_state.json"))
        rng = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "shuffle": self.shuffle_generator.get_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        torch.save(rng, os.path.join(output_dir, f"rng_state_{self.accelerator.process_index}.pth"))
        self.accelerator.wait_for_everyone()
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        return output_dir

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        """Restore everything `save_checkpoint` wrote (for the step API; `train(resume_from_checkpoint=...)` calls
        it)."""
        if not os.path.isfile(os.path.join(checkpoint_dir, STATE_FILE)):
            raise ValueError(f"{checkpoint_dir} is not a PPOTrainer checkpoint (no {STATE_FILE}).")
        unwrapped = self.unwrapped()
        weights = torch.load(os.path.join(checkpoint_dir, TRAINABLE_FILE), map_location="cpu")
        missing = {n for n, p in unwrapped.named_parameters() if p.requires_grad} - set(weights)
        if missing:
            raise ValueError(f"Checkpoint {checkpoint_dir} lacks trainable weights such as {sorted(missing)[:3]}.")
        unwrapped.load_state_dict(weights, strict=False)
        self.optimizer.load_state_dict(
            torch.load(os.path.join(checkpoint_dir, "optimizer.pt"), map_location="cpu", weights_only=False)
        )
        sched_path = os.path.join(checkpoint_dir, "scheduler.pt")
        if self.lr_scheduler is not None and os.path.isfile(sched_path):
            self.lr_scheduler.load_state_dict(torch.load(sched_path, weights_only=False))
        self._load_algorithm_state(torch.load(os.path.join(checkpoint_dir, STATE_FILE), weights_only=False))
        loaded = TrainerState.load_from_json(os.path.join(checkpoint_dir, "trainer_state.json"))
        self.state.global_step = loaded.global_step
        self.state.epoch = loaded.epoch
        self.state.log_history = loaded.log_history
        rng_path = os.path.join(checkpoint_dir, f"rng_state_{self.accelerator.process_index}.pth")
        if os.path.isfile(rng_path):
            rng = torch.load(rng_path, weights_only=False)
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])
            self.shuffle_generator.set_state(rng["shuffle"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])

    # ------------------------------------------------------------------ supplied by the trainer
    def _algorithm_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_algorithm_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError
