"""GRPO's checkpoints (docs/reliability.md): transformers' `Trainer` writes them, `MarkedCheckpoints` marks them
complete, and `train` resumes from the newest complete one with trl_stable's state; the transformers / TRL members
used are listed in `trl_stable.integration.trl_members`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from trl_stable.integration.hf_names import rng_state_file
from trl_stable.settings.checks import ignored_setting
from trl_stable.trainers.checkpoints import MarkedCheckpoints, resolve_checkpoint


class GRPOCheckpoints(MarkedCheckpoints):
    """Complete-or-skipped checkpoints and full resume for TRL's GRPOTrainer."""

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, ignore_keys_for_eval=None):
        """`transformers.Trainer.train`, resuming from the newest *complete* checkpoint (`resolve_checkpoint`) and
        restoring trl_stable's state; ``args.resume_from_checkpoint`` alone is not read (as in TRL): warned."""
        if resume_from_checkpoint is None and self.args.resume_from_checkpoint is not None:
            ignored_setting(
                f"resume_from_checkpoint={self.args.resume_from_checkpoint!r} is not read by trainer.train() (as in "
                "transformers and TRL, the field is for your script): this run starts from scratch. Call "
                "trainer.train(resume_from_checkpoint=args.resume_from_checkpoint), or unset it.",
                stacklevel=3,
            )
        info = resolve_checkpoint(
            resume_from_checkpoint,
            self.args.output_dir,
            self.accelerator.num_processes,
            per_process=(rng_state_file(self),),  # transformers loads it only if present: here it is required
        )
        if info is not None:
            self._restore_stable_state(info)
        return super().train(
            resume_from_checkpoint=None if info is None else info.path,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
        )

    def _write_checkpoint_files(self, trial: Any, run_dir: str, folder: str) -> None:
        """The files `trl.GRPOTrainer._save_checkpoint` writes, in its order: TRL's model card, transformers' files
        (`MarkedCheckpoints`), then TRL's adaptive-entropy state."""
        hub_model_id = self.args.hub_model_id
        self.create_model_card(
            model_name=Path(self.args.output_dir).name if hub_model_id is None else hub_model_id.split("/")[-1]
        )
        super()._write_checkpoint_files(trial, run_dir, folder)
        if self.use_adaptive_entropy and self.args.should_save:
            with open(os.path.join(folder, "entropy_ctrl_state.json"), "w") as f:
                json.dump({"entropy_coef": self.entropy_coef, "last_world_entropy": self._last_world_entropy}, f)
