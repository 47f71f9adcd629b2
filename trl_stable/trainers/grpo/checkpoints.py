"""GRPO's checkpoints: transformers' `Trainer` writes them; trl_stable marks them complete, adds its own state, and
resumes from the newest complete one (see `trl_stable.trainers.checkpoints` for the marker and what it guarantees).

transformers writes ``checkpoint-N`` in place, file by file (model, optimizer, scheduler, RNG, trainer state, then
TRL's extras), and rotates old checkpoints (``save_total_limit``) right after; its own resume takes the
highest-numbered folder whatever it holds, and loads the RNG file only if it is there. `GRPOCheckpoints`, mixed into
`trl_stable.GRPOTrainer` ahead of `trl.GRPOTrainer`:

- marks the folder incomplete before transformers writes it, and complete (with every file's size) once every process
  has written its files, trl_stable's state file included, and flushed them to disk;
- rotates old checkpoints only after that, so a kill while saving leaves the previous complete checkpoint in place;
- resumes (`train`) from the newest complete checkpoint for ``resume_from_checkpoint=True``, checks an explicit one,
  and restores trl_stable's state before transformers' loop starts.

The transformers / TRL members this uses are listed in `trl_stable.integration.trl_members`.
"""

from __future__ import annotations

import os
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

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
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if self.args.should_save:
            begin_marker(folder, self.state.global_step)  # a re-save of this step is incomplete from here on
        self.accelerator.wait_for_everyone()  # no process writes into the folder while it still looks complete
        limit = self.args.save_total_limit
        # Rotation deletes old checkpoints; it must wait until this one is marked complete, or a kill in between
        # leaves no complete checkpoint (save_total_limit=1). transformers reads the limit inside this call only.
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        os.makedirs(folder, exist_ok=True)
        state = collect_stable_state(
            self.health_monitor, self._named_reward_funcs(), *self._trainer_checkpoint_state()
        )
        save_durably(state, os.path.join(folder, stable_state_file(self.accelerator.process_index)))
        self.accelerator.wait_for_everyone()  # every process's files are written before the marker lists them
        if self.args.should_save:
            fsync_tree(folder)  # transformers does not flush its files
            write_marker(folder, self.state.global_step, self.accelerator.num_processes)
            rotate_checkpoints(  # what transformers' _save_checkpoint would have done (trl_members.MIRRORED)
                output_dir=run_dir,
                save_total_limit=limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
