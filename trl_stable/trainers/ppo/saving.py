"""PPO's files in `transformers.Trainer`'s saving and resume (a `PPOTrainer` mixin), the step API's checkpoints and
the model card's value-head section."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from transformers.integrations.deepspeed import deepspeed_load_checkpoint
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trl_stable.integration.hf_names import rng_state_file
from trl_stable.trainers.checkpoints import TRAINER_STATE_FILE, CheckpointInfo, resolve_checkpoint
from trl_stable.trainers.ppo.value_head import VALUE_HEAD_FILE, ValueHead

logger = logging.getLogger(__name__)

VALUE_MODEL_DIR = "value_model"


class SaveAndResume:
    """`PPOTrainer`'s save and resume; the checkpoint folder itself is `MarkedCheckpoints`' (both trainers')."""

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The policy (or LoRA adapter), value head (a separate value model under `value_model/`), tokenizer and
        arguments; `state_dict`: the gathered weights of the whole `PolicyAndValue` (ZeRO-3, FSDP)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        unwrapped = self.unwrapped()

        def part(prefix: str) -> dict[str, Any]:
            if state_dict is None:
                return {}
            return {"state_dict": {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}}

        unwrapped.policy.save_pretrained(output_dir, **part("policy."))
        unwrapped.value_head.save_pretrained(output_dir, **part("value_head."))
        if unwrapped.value_backbone is not None:
            value_dir = os.path.join(output_dir, VALUE_MODEL_DIR)
            unwrapped.value_backbone.save_pretrained(value_dir, **part("value_backbone."))
        self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))  # `PPOConfig` pickles without secrets

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """Load what `_save` wrote, through Trainer's loader (under FSDP it reads the engine's own files)."""
        if self.is_fsdp_enabled:
            return super()._load_from_checkpoint(resume_from_checkpoint, model or self.model_wrapped)
        unwrapped = self.unwrapped()
        super()._load_from_checkpoint(resume_from_checkpoint, model=unwrapped.policy)
        head = os.path.join(resume_from_checkpoint, VALUE_HEAD_FILE)
        if not os.path.isfile(head):
            raise ValueError(f"{resume_from_checkpoint} has no {VALUE_HEAD_FILE}: it was not written by PPOTrainer.")
        unwrapped.value_head.load_state_dict(ValueHead.from_pretrained(resume_from_checkpoint).state_dict())
        if unwrapped.value_backbone is not None:
            value_dir = os.path.join(resume_from_checkpoint, VALUE_MODEL_DIR)
            super()._load_from_checkpoint(value_dir, unwrapped.value_backbone)

    def _load_best_model(self) -> None:
        """`load_best_model_at_end`: the best checkpoint's policy and value head (the engines load their own files)."""
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return super()._load_best_model()
        logger.info(f"Loading the best model from {self.state.best_model_checkpoint} ({self.state.best_metric}).")
        self._load_from_checkpoint(self.state.best_model_checkpoint)

    def _trainer_checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(shared, per-process) checkpoint state: KL coefficient, score statistics; shuffling."""
        shared = {"kl_coef": self.kl_ctl.value, "running": self.running.state_dict()}
        return shared, {"shuffle": self.shuffle_generator.get_state()}

    def _load_trainer_checkpoint_state(self, shared: dict[str, Any], per_process: dict[str, Any] | None) -> None:
        self.kl_ctl.value = shared["kl_coef"]
        self.running.load_state_dict(shared["running"])
        if per_process is not None:
            self.shuffle_generator.set_state(per_process["shuffle"])

    def _named_reward_funcs(self) -> list[tuple[str, Any]]:
        """The reward functions whose state is saved: the trainer's and those a step-API loop registered."""
        extra = [(getattr(f, "__name__", type(f).__name__), f) for f in self._step_api_reward_funcs]
        return [*zip(self.rewards.names, self.rewards.funcs), *extra]

    def _track(self, reward_funcs: Sequence[Any]) -> None:
        for func in reward_funcs:
            if not any(func is known for known in self._step_api_reward_funcs):
                self._step_api_reward_funcs.append(func)

    def _resolve_checkpoint(self, resume_from_checkpoint: str | bool | None) -> CheckpointInfo | None:
        """The checkpoint to resume from (True: the newest complete one in `args.output_dir`; a folder is checked)."""
        return resolve_checkpoint(
            resume_from_checkpoint,
            self.args.output_dir,
            self.accelerator.num_processes,
            per_process=() if self.args.save_only_model else (rng_state_file(self),),
        )

    def _load_checkpoint(self, info: CheckpointInfo) -> None:
        """Restore a checkpoint as Trainer's resume reads it, then trl_stable's state (`_trainer_checkpoint_state`)."""
        path = info.path
        if self.is_deepspeed_enabled:
            deepspeed_load_checkpoint(self.model_wrapped, path, load_module_strict=not self.is_peft)
        else:
            self._load_from_checkpoint(path)
        self._load_optimizer_and_scheduler(path)
        self._load_scaler(path)
        self.state = TrainerState.load_from_json(os.path.join(path, TRAINER_STATE_FILE))
        self.state.init_training_references(self, self.state.max_steps, self.args.num_train_epochs, None)
        self._load_callback_state()
        if info.same_processes:
            self._load_rng_state(path)
        self._restore_stable_state(info)

    def save_checkpoint(self, output_dir: str | None = None, reward_funcs: Sequence[Any] = ()) -> str:
        """Save a resumable checkpoint now, as `train()` does per `save_strategy`, on every process; returns the
        folder, ``args.output_dir/checkpoint-{global_step}`` (`output_dir` must be None or it). `reward_funcs` the
        trainer does not hold (a step-API loop's critic) have their ``checkpoint_state()`` saved too."""
        final = os.path.join(self._get_output_dir(trial=None), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if output_dir is not None and os.path.normpath(output_dir) != os.path.normpath(final):
            raise ValueError(
                f"save_checkpoint writes {final} (as Trainer), not {output_dir}: set PPOConfig.output_dir."
            )
        self._track(reward_funcs)
        self._save_checkpoint(self.model_wrapped, trial=None)
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        return final

    def load_checkpoint(self, checkpoint_dir: str | CheckpointInfo, reward_funcs: Sequence[Any] = ()) -> None:
        """Restore everything `save_checkpoint` wrote into a complete `checkpoint_dir` (ValueError names what is
        missing); `reward_funcs` as in `save_checkpoint`."""
        self._track(reward_funcs)
        if not isinstance(checkpoint_dir, CheckpointInfo):
            if not checkpoint_dir:
                raise ValueError(f"load_checkpoint needs a checkpoint folder, got {checkpoint_dir!r}.")
            checkpoint_dir = self._resolve_checkpoint(checkpoint_dir)
        self._load_checkpoint(checkpoint_dir)

    def create_model_card(
        self, model_name: str | None = None, dataset_name: str | None = None, tags: str | list[str] | None = None
    ) -> None:
        """TRL's model card plus a section on the value head and how to load the policy. Main process only."""
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        if self.is_peft:
            tags.append("peft")
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return
        policy = (
            "a LoRA adapter: load it with `peft.AutoPeftModelForCausalLM.from_pretrained`"
            if self.is_peft
            else "a full causal LM: load it with `transformers.AutoModelForCausalLM.from_pretrained`"
        )
        critic = (
            f"on the policy's last hidden state (`{VALUE_HEAD_FILE}`)"
            if self.unwrapped().value_backbone is None
            else f"on a separate critic, saved under `{VALUE_MODEL_DIR}/` with its head in `{VALUE_HEAD_FILE}`"
        )
        with open(os.path.join(self.args.output_dir, "README.md"), "a", encoding="utf-8") as f:
            f.write(
                "\n\n## PPO value head\n\n"
                f"The policy is {policy}. The trained value head is a scalar head {critic}, kept to resume PPO or to "
                "score states; load it with `trl_stable.trainers.ppo.value_head.ValueHead.from_pretrained(folder)`.\n"
            )
