"""GRPO's checkpoints: transformers' `Trainer` writes them; trl_stable marks them complete, adds its own state, and
resumes from the newest complete one (see `trl_stable.trainers.checkpoints` for the marker and what it guarantees).

transformers writes ``checkpoint-N`` in place, file by file (model, optimizer, scheduler, RNG, trainer state, then
TRL's extras), and its `_save_checkpoint` rotates old checkpoints (``save_total_limit``) at its end, before anything
after it could mark the new one complete; its own resume takes the highest-numbered folder whatever it holds, and
loads the RNG file only if it is there. `GRPOCheckpoints`, mixed into `trl_stable.GRPOTrainer` ahead of
`trl.GRPOTrainer`:

- writes the files TRL's `_save_checkpoint` writes, with the same TRL / transformers helpers in the same order
  (`_write_checkpoint_files`), marking the folder incomplete before and complete (with every file's size) once every
  process has written its files, trl_stable's state file included, and flushed them to disk;
- pushes it and rotates old checkpoints only after that (transformers' `rotate_checkpoints`, given the limit
  explicitly; the arguments are never changed), so a kill while saving leaves the previous complete checkpoint;
- resumes (`train`) from the newest complete checkpoint for ``resume_from_checkpoint=True``, checks an explicit one,
  and restores trl_stable's state before transformers' loop starts.

The transformers / TRL members this uses are listed in `trl_stable.integration.trl_members`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy, rotate_checkpoints

from trl_stable.integration.hf_names import rng_state_file
from trl_stable.trainers.checkpoints import (
    begin_marker,
    collect_stable_state,
    fsync_tree,
    load_stable_state,
    resolve_checkpoint,
    restore_stable_state,
    save_durably,
    stable_state_file,
    write_marker,
)

__all__ = ["GRPOCheckpoints"]


class GRPOCheckpoints:
    """Complete-or-skipped checkpoints and full resume for a `transformers.Trainer` subclass.

    The trainer supplies `_named_reward_funcs()` and `_trainer_checkpoint_state()` /
    `_load_trainer_checkpoint_state(shared, per_process)` for its own state, and has a `health_monitor` (or None).
    """

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, ignore_keys_for_eval=None):
        """`transformers.Trainer.train`, resuming from the newest *complete* checkpoint for
        ``resume_from_checkpoint=True`` (newer incomplete ones are skipped and logged), checking an explicit one
        (ValueError naming the folder and the fix when it is incomplete or has no ``trainer_state.json``), and
        restoring trl_stable's state: the health monitor, reward-function counters, the dynamic-sampling refill RNG
        and the NaN-reward count."""
        info = resolve_checkpoint(
            resume_from_checkpoint,
            self.args.output_dir,
            self.accelerator.num_processes,
            per_process=(rng_state_file(self),),  # transformers loads it only if present: here it is required
        )
        if info is not None:
            state = load_stable_state(info, self.accelerator.process_index)
            if state is not None:
                restore_stable_state(state, self.health_monitor, self._named_reward_funcs(), self.args)
                self._load_trainer_checkpoint_state(state["shared"], state["per_process"])
        return super().train(
            resume_from_checkpoint=None if info is None else info.path,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
        )

    def _save_checkpoint(self, model, trial):
        """Write ``checkpoint-N`` as `trl.GRPOTrainer._save_checkpoint` does (`_write_checkpoint_files`), marked
        incomplete while it is written and complete once every process's files (trl_stable's state file included)
        are on disk; then push it (``push_to_hub``) and rotate old checkpoints, in transformers' order. Rotation is
        transformers' own helper, given the limit explicitly: it runs only once the new checkpoint is complete, so
        a kill while saving leaves the previous complete checkpoint in place (``save_total_limit=1`` included)."""
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            begin_marker(folder, self.state.global_step)  # a re-save of this step is incomplete from here on
        self.accelerator.wait_for_everyone()  # no process writes into the folder while it still looks complete
        self._write_checkpoint_files(trial, run_dir, folder)
        os.makedirs(folder, exist_ok=True)
        state = collect_stable_state(
            self.health_monitor, self._named_reward_funcs(), *self._trainer_checkpoint_state()
        )
        save_durably(state, os.path.join(folder, stable_state_file(self.accelerator.process_index)))
        self.accelerator.wait_for_everyone()  # every process's files are written before the marker lists them
        if self.args.should_save:
            fsync_tree(folder)  # transformers does not flush its files
            write_marker(folder, self.state.global_step, self.accelerator.num_processes)
        if self.args.push_to_hub:
            self._push_from_checkpoint(folder)
        if self.args.should_save:
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    def _write_checkpoint_files(self, trial: Any, run_dir: str, folder: str) -> None:
        """The files `trl.GRPOTrainer._save_checkpoint` writes, step for step and in its order, each by the TRL or
        transformers helper the original calls, given `folder` explicitly: TRL's model card, then
        `transformers.Trainer._save_checkpoint`'s model, best-checkpoint bookkeeping, optimizer, scheduler, scaler,
        RNG and trainer state, then TRL's adaptive-entropy state. Left out: the push and the rotation that end
        transformers' method, which `_save_checkpoint` runs after the marker (MIRRORED names every line, and the
        contract test fails when either method gains or loses a call)."""
        # trl.GRPOTrainer._save_checkpoint, before its super() call
        hub_model_id = self.args.hub_model_id
        self.create_model_card(
            model_name=Path(self.args.output_dir).name if hub_model_id is None else hub_model_id.split("/")[-1]
        )
        # transformers.Trainer._save_checkpoint
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        self.save_model(folder, _internal_call=True)
        if self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and (
            self.state.best_global_step
        ):
            self.accelerator.wait_for_everyone()  # the main process saved the model before the best is looked for
            best_checkpoint_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.exists(best_checkpoint_dir):
                self.state.best_model_checkpoint = best_checkpoint_dir
        if not self.args.save_only_model:
            self._save_optimizer_and_scheduler(folder)
            self._save_scaler(folder)
            self._save_rng_state(folder)
        if self.args.should_save:
            for callback in self.callback_handler.callbacks + [self.control]:
                if isinstance(callback, ExportableState):
                    name = callback.__class__.__name__
                    if isinstance(self.state.stateful_callbacks[name], list):
                        self.state.stateful_callbacks[name].append(callback.state())
                    else:
                        self.state.stateful_callbacks[name] = callback.state()
            self.state.save_to_json(os.path.join(folder, TRAINER_STATE_NAME))
        # trl.GRPOTrainer._save_checkpoint, after its super() call
        if self.use_adaptive_entropy and self.args.should_save:
            with open(os.path.join(folder, "entropy_ctrl_state.json"), "w") as f:
                json.dump({"entropy_coef": self.entropy_coef, "last_world_entropy": self._last_world_entropy}, f)
