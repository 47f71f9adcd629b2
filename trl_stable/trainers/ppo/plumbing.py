"""The `transformers.Trainer`-like plumbing of trl_stable's PPOTrainer: state, callbacks, logging, saving, resuming.

PPO's step does not fit `Trainer.training_step` (one rollout feeds several optimiser steps over shuffled
mini-batches, and the step API is driven by the user's loop), so `PPOTrainer` keeps its own loop and takes the parts
of `Trainer` users rely on from here: a `TrainerState` with `log_history`, `TrainerCallback`s (progress bar,
reporting integrations, the health monitor), `save_model`, and resumable checkpoints.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from huggingface_hub import HfApi
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

from trl_stable.trainers.checkpoints import (
    TMP_PREFIX,
    TRAINER_STATE_FILE,
    CheckpointInfo,
    collect_stable_state,
    fsync_tree,
    load_stable_state,
    publish,
    resolve_checkpoint,
    restore_stable_state,
    save_durably,
    stable_state_file,
    temporary_folder,
    write_marker,
)
from trl_stable.trainers.ppo.engines import ENGINE_STATE_DIR

__all__ = ["PPOPlumbing"]

# Not uploaded by `push_to_hub`: transformers' own ignore list (private files, checkpoints), and the hidden folders
# an interrupted checkpoint save leaves behind.
HUB_IGNORE_PATTERNS = ("_*", "checkpoint-*", f"{TMP_PREFIX}*")
PPO_CITATION = """\
@article{schulman2017proximal,
    title        = {{Proximal Policy Optimization Algorithms}},
    author       = {John Schulman and Filip Wolski and Prafulla Dhariwal and Alec Radford and Oleg Klimov},
    year         = 2017,
    eprint       = {arXiv:1707.06347}
}"""

STATE_FILE = "ppo_state.pt"
TRAINABLE_FILE = "trainable_weights.pt"
SCHEDULER_FILE = "scheduler.pt"


def rng_file(process_index: int) -> str:
    """The RNG-state file of process `process_index` in a PPO checkpoint."""
    return f"rng_state_{process_index}.pth"


class PPOPlumbing:
    """State, callbacks, logging and checkpoints for a trainer with its own loop.

    The trainer sets `args`, `accelerator`, `model_wrapped` (a `PolicyAndValue`, possibly DDP-wrapped),
    `processing_class`, `optimizer`, `lr_scheduler` and a `shuffle_generator`, then calls `_init_plumbing`. It
    supplies `_algorithm_state()` / `_load_algorithm_state(state)` for what its checkpoints add (e.g. the KL
    coefficient) and `_named_reward_funcs()` (reward functions with checkpoint state, such as critic counters).
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
        full = self._full_state_dict()
        if self.accelerator.is_main_process:
            self._write_model(output_dir, full)
        self.accelerator.wait_for_everyone()

    def _sharded_engine(self, what: str) -> bool:
        engine = getattr(self, "engine", None)
        return engine is not None and bool(getattr(engine, what))

    def _full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Under ZeRO-3 / FSDP, the full `PolicyAndValue` state dict gathered from every process (a collective:
        call it on every process; the main process gets it). None elsewhere: every process holds the full weights."""
        if not self._sharded_engine("shards_parameters"):
            return None
        return self.accelerator.get_state_dict(self.model_wrapped)

    def _write_model(self, output_dir: str, full_state: dict[str, torch.Tensor] | None = None) -> None:
        """Write what `save_model` saves, from this process alone: no collective, so it may run under
        ``if accelerator.is_main_process:`` (DDP keeps a full copy of the weights on every process; under ZeRO-3 /
        FSDP pass `full_state`, `_full_state_dict()`'s gathered weights)."""
        unwrapped = self.unwrapped()
        os.makedirs(output_dir, exist_ok=True)

        def part(prefix: str) -> dict[str, Any]:
            # no `state_dict` key at all without full weights: the plain save path, as before engines existed
            if full_state is None:
                return {}
            return {"state_dict": {k[len(prefix) :]: v for k, v in full_state.items() if k.startswith(prefix)}}

        unwrapped.policy.save_pretrained(output_dir, **part("policy."))
        self.processing_class.save_pretrained(output_dir)
        unwrapped.value_head.save_pretrained(output_dir, **part("value_head."))
        if unwrapped.value_backbone is not None:
            value_dir = os.path.join(output_dir, "value_model")
            unwrapped.value_backbone.save_pretrained(value_dir, **part("value_backbone."))

    # ------------------------------------------------------------------ the Hub
    def _hub_repo_name(self) -> str:
        return self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir))

    def create_model_card(
        self, model_name: str | None = None, dataset_name: str | None = None, tags: str | list[str] | None = None
    ) -> None:
        """Write `output_dir/README.md`: TRL's model card (`trl.trainer.utils.generate_model_card`, as TRL's
        trainers write it) plus a section on the value head and how to load the policy (adapter or full model).
        Main process only."""
        if not self.accelerator.is_main_process:
            return
        from trl.trainer.utils import generate_model_card

        from trl_stable.trl_internals import model_name_of

        unwrapped = self.unwrapped()
        base_model = getattr(self.args, "model_name", None) or model_name_of(unwrapped.policy)
        if base_model and os.path.isdir(base_model):  # a local path names no Hub model
            base_model = None
        tags = {tags} if isinstance(tags, str) else set(tags or ())
        tags.update({"trl", "ppo", "trl_stable"})
        if getattr(self, "is_peft", False):
            tags.add("peft")
        card = generate_model_card(
            base_model=base_model,
            model_name=model_name or self._hub_repo_name().split("/")[-1],
            hub_model_id=self._hub_repo_name(),
            dataset_name=dataset_name,
            tags=sorted(tags),
            wandb_url=None,
            trackio_url=None,
            trainer_name="PPO",
            trainer_citation=PPO_CITATION,
            paper_title="Proximal Policy Optimization Algorithms",
            paper_id="1707.06347",
        )
        card.text += self._value_head_card_section(unwrapped)
        os.makedirs(self.args.output_dir, exist_ok=True)
        card.save(os.path.join(self.args.output_dir, "README.md"))

    def _value_head_card_section(self, unwrapped: Any) -> str:
        policy = (
            "a LoRA adapter: load it with `peft.AutoPeftModelForCausalLM.from_pretrained`"
            if getattr(self, "is_peft", False)
            else "a full causal LM: load it with `transformers.AutoModelForCausalLM.from_pretrained`"
        )
        critic = (
            "on the policy's last hidden state (`value_head.safetensors`)"
            if unwrapped.value_backbone is None
            else "on a separate critic, saved under `value_model/` with its head in `value_head.safetensors`"
        )
        return (
            "\n\n## PPO value head\n\n"
            f"The policy is {policy}. The trained value head is a scalar head {critic}, kept to resume PPO or to "
            "score states; load it with `trl_stable.trainers.ppo.value_head.ValueHead.from_pretrained(folder)`.\n"
        )

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """Upload the policy (full model or LoRA adapter), tokenizer, value head and a model card to the Hub repo
        `args.hub_model_id` (default: the `output_dir` folder's name), as `transformers.Trainer.push_to_hub` does:
        `save_model` into `output_dir`, `create_model_card`, then one `upload_folder` of `output_dir` without its
        checkpoints. Call it on every process (saving waits for all); only the main process uploads.

        Args:
            commit_message: The Hub commit message.
            blocking: False: return a `Future` of the upload (`run_as_future`).
            token: Token with write access; None: `args.hub_token`, else the logged-in token. It is passed to the
                Hub client only, never written to a file.
            revision: The branch to commit to; None: `args.hub_revision` (the default branch when unset).
            private: Make a new repo private; None: `args.hub_private_repo`.
            kwargs: `create_model_card`'s `model_name`, `dataset_name`, `tags`.

        Returns:
            The upload's `CommitInfo` (a `Future` when not blocking); None on the other processes.
        """
        args = self.args
        token = token if token is not None else args.hub_token
        self.save_model(args.output_dir)
        if not self.accelerator.is_main_process:
            return None
        self.create_model_card(**kwargs)
        api = HfApi()
        repo = api.create_repo(
            self._hub_repo_name(),
            token=token,
            private=private if private is not None else args.hub_private_repo,
            exist_ok=True,
        )
        return api.upload_folder(
            repo_id=repo.repo_id,
            folder_path=args.output_dir,
            commit_message=commit_message,
            token=token,
            run_as_future=not blocking,
            ignore_patterns=list(HUB_IGNORE_PATTERNS),
            revision=revision if revision is not None else getattr(args, "hub_revision", None),
        )

    def save_checkpoint(self, output_dir: str | None = None, reward_funcs: Sequence[Any] = ()) -> str:
        """Save a resumable checkpoint (weights, optimizer, scheduler, the algorithm's state, RNG, trainer state,
        trl_stable's state: health monitor, reward-function counters); returns its directory (default
        `output_dir/checkpoint-{global_step}`). Call it on every process.

        `reward_funcs`: reward functions the trainer does not hold (a step-API loop's critic) whose
        ``checkpoint_state()`` is saved too; pass the same to `load_checkpoint`.

        Atomic: everything is written into a temporary folder next to the final one, flushed to disk, marked
        complete and renamed (`trl_stable.trainers.checkpoints`), so the directory exists only complete; a kill while
        saving leaves the temporary folder, which resume skips. An existing checkpoint of the same name is replaced.
        """
        final = os.path.normpath(
            output_dir or os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        )
        tmp = temporary_folder(final)
        accelerator = self.accelerator
        main = accelerator.is_main_process
        accelerator.wait_for_everyone()  # every process is done with the step before the folder is (re)made
        engine_state = self._sharded_engine("shards_state")
        full = self._full_state_dict()  # a collective, before the main-process-only writes
        if main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by an earlier save of this step that was killed
            os.makedirs(tmp)
        accelerator.wait_for_everyone()  # the folder exists before the other processes write into it
        if main:
            # `_write_model`, not `save_model`: the latter waits for the other processes, which are not in this branch
            self._write_model(tmp, full)
            if not engine_state:
                unwrapped = self.unwrapped()
                trainable = {n for n, p in unwrapped.named_parameters() if p.requires_grad}
                weights = {k: v.detach().cpu() for k, v in unwrapped.state_dict().items() if k in trainable}
                save_durably(weights, os.path.join(tmp, TRAINABLE_FILE))
                save_durably(self.optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
            if self.lr_scheduler is not None:
                save_durably(self.lr_scheduler.state_dict(), os.path.join(tmp, SCHEDULER_FILE))
            save_durably(self._algorithm_state(), os.path.join(tmp, STATE_FILE))
            self.state.stateful_callbacks = {
                type(cb).__name__: cb.state()
                for cb in self.callback_handler.callbacks
                if isinstance(cb, ExportableState)
            }
            self.state.save_to_json(os.path.join(tmp, TRAINER_STATE_FILE))
        if engine_state:
            # DeepSpeed / FSDP: weights and optimizer state in per-process shards, written by every process inside
            # the temporary folder, so the checkpoint stays one atomic unit
            accelerator.save_state(os.path.join(tmp, ENGINE_STATE_DIR))
        rng = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "shuffle": self.shuffle_generator.get_state(),
        }
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        rank = accelerator.process_index
        # part of the atomic unit: a checkpoint without this process's RNG would resume differently, silently
        save_durably(rng, os.path.join(tmp, rng_file(rank)))
        save_durably(self._stable_state(reward_funcs), os.path.join(tmp, stable_state_file(rank)))
        accelerator.wait_for_everyone()  # every process's files are on disk before the marker lists them
        if main:
            fsync_tree(tmp)  # save_pretrained does not flush
            write_marker(tmp, self.state.global_step, accelerator.num_processes)
            publish(tmp, final)
        accelerator.wait_for_everyone()  # no process reports or reads the checkpoint before it is in place
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        return final

    def _all_reward_funcs(self, extra: Sequence[Any]) -> list[tuple[str, Any]]:
        return self._named_reward_funcs() + [(getattr(f, "__name__", type(f).__name__), f) for f in extra]

    def _stable_state(self, reward_funcs: Sequence[Any]) -> dict[str, Any]:
        return collect_stable_state(getattr(self, "health_monitor", None), self._all_reward_funcs(reward_funcs))

    def _resolve_checkpoint(self, resume_from_checkpoint: str | bool | None) -> CheckpointInfo | None:
        """The checkpoint `train(resume_from_checkpoint=...)` resumes from: True takes the newest complete one in
        `args.output_dir` (logging the newer ones skipped, and why); a folder is checked. Raises ValueError, naming
        the folder and the fix, for an incomplete one."""
        rank = self.accelerator.process_index
        engine_state = self._sharded_engine("shards_state")
        return resolve_checkpoint(
            resume_from_checkpoint,
            self.args.output_dir,
            self.accelerator.num_processes,
            required=(STATE_FILE,) if engine_state else (STATE_FILE, TRAINABLE_FILE, "optimizer.pt"),
            per_process=(rng_file(rank),),
        )

    def load_checkpoint(self, checkpoint_dir: str | CheckpointInfo, reward_funcs: Sequence[Any] = ()) -> None:
        """Restore everything `save_checkpoint` wrote (for the step API; `train(resume_from_checkpoint=...)` calls
        it), `reward_funcs` as in `save_checkpoint`. The folder must be a complete checkpoint (its RNG file
        included); ValueError names the folder, what is missing and the fix."""
        info = checkpoint_dir
        if not isinstance(info, CheckpointInfo):
            if not checkpoint_dir:
                raise ValueError(f"load_checkpoint needs a checkpoint folder, got {checkpoint_dir!r}.")
            info = self._resolve_checkpoint(checkpoint_dir)
        checkpoint_dir = info.path
        engine_dir = os.path.join(checkpoint_dir, ENGINE_STATE_DIR)
        if self._sharded_engine("shards_state"):
            if not os.path.isdir(engine_dir):
                raise ValueError(
                    f"Checkpoint {checkpoint_dir} has no {ENGINE_STATE_DIR}/ folder: it was not written under "
                    "DeepSpeed / FSDP. Resume it with the engine that wrote it (the same accelerate config)."
                )
            self.accelerator.load_state(engine_dir)
        else:
            if os.path.isdir(engine_dir):
                raise ValueError(
                    f"Checkpoint {checkpoint_dir} was written under DeepSpeed / FSDP ({ENGINE_STATE_DIR}/ holds its "
                    "sharded weights and optimizer): resume it with the same accelerate config."
                )
            unwrapped = self.unwrapped()
            weights = torch.load(os.path.join(checkpoint_dir, TRAINABLE_FILE), map_location="cpu")
            missing = {n for n, p in unwrapped.named_parameters() if p.requires_grad} - set(weights)
            if missing:
                raise ValueError(f"Checkpoint {checkpoint_dir} lacks trainable weights such as {sorted(missing)[:3]}.")
            unwrapped.load_state_dict(weights, strict=False)
            self.optimizer.load_state_dict(
                torch.load(os.path.join(checkpoint_dir, "optimizer.pt"), map_location="cpu", weights_only=False)
            )
        sched_path = os.path.join(checkpoint_dir, SCHEDULER_FILE)
        # a step-API checkpoint has no scheduler (the marker vouches that none was lost): train() starts its own
        if self.lr_scheduler is not None and os.path.isfile(sched_path):
            self.lr_scheduler.load_state_dict(torch.load(sched_path, weights_only=False))
        self._load_algorithm_state(torch.load(os.path.join(checkpoint_dir, STATE_FILE), weights_only=False))
        loaded = TrainerState.load_from_json(os.path.join(checkpoint_dir, TRAINER_STATE_FILE))
        self.state.global_step = loaded.global_step
        self.state.epoch = loaded.epoch
        self.state.log_history = loaded.log_history
        if info.same_processes:
            rng = torch.load(
                os.path.join(checkpoint_dir, rng_file(self.accelerator.process_index)), weights_only=False
            )
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])
            self.shuffle_generator.set_state(rng["shuffle"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        stable = load_stable_state(info, self.accelerator.process_index)
        if stable is not None:
            monitor = getattr(self, "health_monitor", None)
            restore_stable_state(stable, monitor, self._all_reward_funcs(reward_funcs), self.args)

    # ------------------------------------------------------------------ supplied by the trainer
    def _algorithm_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_algorithm_state(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _named_reward_funcs(self) -> list[tuple[str, Any]]:
        """(name, function) of the reward functions, whose checkpoint state (e.g. critic counters) is saved."""
        return []
