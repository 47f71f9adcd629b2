"""What `transformers.Trainer`'s loop does around its steps, done around PPO's (a `PPOTrainer` mixin): the run's
length, the state and `on_train_begin` before the first step, and after each step its count, `on_step_end`, logging,
evaluation and saving as the callbacks' flags say."""

from __future__ import annotations

import math

from accelerate.utils.memory import clear_device_cache
from transformers.trainer_utils import SaveStrategy

# transformers' schedules that need the run's length in optimizer steps (the others run without a horizon)
_HORIZON_FREE_SCHEDULES = ("constant", "constant_with_warmup", "reduce_lr_on_plateau")


class LoopEvents:
    """`PPOTrainer`'s loop events; reads `args`, `state`, `control`, `callback_handler` and `train_dataloader`."""

    def _max_steps(self, check: bool = True) -> int:
        """The PPO steps `train()` runs: `max_steps`, or `num_train_epochs` passes over the train dataloader. A
        dataset smaller than one step raises (`check`) or gives 0."""
        args = self.args
        if args.max_steps > 0:
            return args.max_steps
        steps_per_epoch = len(self.train_dataloader)
        if steps_per_epoch == 0 and check:
            raise ValueError(
                f"train_dataset has {len(self.train_dataset)} rows, fewer than one step's batch_size x processes = "
                f"{args.batch_size * self.accelerator.num_processes}; lower batch_size or add prompts."
            )
        return math.ceil(args.num_train_epochs * steps_per_epoch)

    def _scheduler_horizon(self) -> int:
        """The run's length in optimizer steps, for the schedule; 1 when it needs none and none is known."""
        args = self.args
        steps = self._max_steps(check=False) if self.train_dataloader is not None else max(args.max_steps, 0)
        if steps:
            mini_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
            return steps * args.ppo_epochs * (args.batch_size // mini_batch)
        schedule = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
        needs_horizon = schedule not in _HORIZON_FREE_SCHEDULES
        if needs_horizon or 0 < args.warmup_steps < 1:
            what = f"lr_scheduler_type={schedule!r}" if needs_horizon else f"warmup_steps={args.warmup_steps}"
            raise ValueError(
                f"{what} needs the run's length (no train_dataset or max_steps): set max_steps (the step API's PPO "
                "steps), or use lr_scheduler_type='constant' / 'constant_with_warmup' with warmup_steps >= 1."
            )
        return 1

    def _begin(self, max_steps: int) -> None:
        """Before the first step, as Trainer: the run's length and logging/eval/save steps in the state, then
        on_train_begin. The step API calls it at its first step (0: no planned length)."""
        self.state.max_steps = max_steps
        self.state.compute_steps(self.args, max(max_steps, 1))
        self.state.init_training_references(self, max_steps, self.args.num_train_epochs, None)
        self.control = self.callback_handler.on_train_begin(self.args, self.state, self.control)
        self._train_begun = True

    def _end_step(self, logs: dict[str, float]) -> None:
        """After a PPO step, what Trainer does after an optimizer step: count it, on_step_end, then log, evaluate and
        save as the flags say."""
        self.state.global_step += 1
        self.control = self.callback_handler.on_step_end(self.args, self.state, self.control)
        if self.state.max_steps <= 0:
            # the step API with no planned length: transformers' end-of-run flags (step >= max_steps) do not apply
            self.control.should_training_stop = False
            save_steps = self.args.save_strategy == SaveStrategy.STEPS and self.state.save_steps > 0
            self.control.should_save = save_steps and self.state.global_step % self.state.save_steps == 0
        if self.control.should_log:
            self.log(dict(logs))  # a copy: Trainer's `log` and the callbacks add to the dict they get
        steps = self.args.torch_empty_cache_steps
        if steps and self.state.global_step % steps == 0:
            clear_device_cache()
        self._maybe_evaluate_and_save()

    def _maybe_evaluate_and_save(self) -> None:
        """The second half of Trainer's `_maybe_log_save_evaluate` (PPO logs its own step statistics)."""
        if self.control.should_evaluate:
            metrics = self._evaluate(trial=None, ignore_keys_for_eval=None)
            is_best = self._determine_best_metric(metrics=metrics, trial=None)
            if self.args.save_strategy == SaveStrategy.BEST:
                self.control.should_save = is_best
        if self.control.should_save:
            self._save_checkpoint(self.model_wrapped, trial=None)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)

    def _logged_this_step(self) -> bool:
        """Whether `state.log_history` already holds an entry of the current step."""
        return bool(self.state.log_history) and self.state.log_history[-1].get("step") == self.state.global_step
