"""`HealthMonitor`: the health rules as a `transformers.TrainerCallback` (docs/health_monitoring.md)."""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict
from typing import Any

from transformers import TrainerCallback

from trl_stable.monitoring.health import HealthConfig, HealthEvent, HealthTracker, json_number

__all__ = ["HealthMonitor", "health_config_from_args"]

logger = logging.getLogger("trl_stable.monitoring")

# Trainer-argument fields (trl_stable GRPOConfig / PPOConfig) that map onto HealthConfig fields.
_ARG_FIELDS = {
    f"health_{name}": name
    for name in ("reward_max", "mismatch_threshold", "remedy_virtual_samples", "stop_after_critical_steps")
}


def health_config_from_args(args: Any) -> HealthConfig | None:
    """The [`HealthConfig`] a trl_stable trainer config asks for (`health_monitor`, the `health_*` shortcut fields,
    then `health_monitor_kwargs`, any [`HealthConfig`] field); None when `health_monitor` is False."""
    if not getattr(args, "health_monitor", True):
        return None
    kwargs = {name: getattr(args, arg) for arg, name in _ARG_FIELDS.items() if hasattr(args, arg)}
    extra = getattr(args, "health_monitor_kwargs", None) or {}
    if not isinstance(extra, dict):
        raise ValueError(f"health_monitor_kwargs must be a dict of HealthConfig fields, got {type(extra).__name__}.")
    known = set(HealthConfig.__dataclass_fields__)
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(f"health_monitor_kwargs has unknown fields {unknown}; valid fields: {sorted(known)}.")
    return HealthConfig(**{**kwargs, **extra})


class HealthMonitor(TrainerCallback):
    """Watches the training logs and raises debounced alarms with symptom, likely cause and remedy.

    It only reads the logs the trainer writes, so it changes no trained number. Alarms go to the
    `trl_stable.monitoring` logger, into the logs (`health/*` flags) and to `output_dir/health.jsonl`. The
    virtual-samples remedy changes no trainer argument: it sets `remedy_active`, which `trl_stable.GRPOTrainer` reads.

    Args:
        config ([`HealthConfig`], *optional*): thresholds, debouncing and remedies.
        **kwargs: [`HealthConfig`] fields, when `config` is not given.

    For the `health/*` flags to reach the reporters (wandb, tensorboard) in the same step, the monitor must run
    before them: [`~HealthMonitor.attach`] puts it first; `trainer.add_callback` appends it last.
    """

    def __init__(self, config: HealthConfig | None = None, **kwargs):
        if config is not None and kwargs:
            raise ValueError("Pass either a HealthConfig or HealthConfig fields as keywords, not both.")
        self.config = config or HealthConfig(**kwargs)
        self.tracker = HealthTracker(self.config)
        self.events: list[HealthEvent] = []
        self.remedy_active = False
        self._stopped = False
        self.health_path: str | None = None

    def attach(self, trainer) -> HealthMonitor:
        """Register with `trainer` ahead of every other callback, so the `health/*` flags reach the reporters."""
        callbacks = trainer.callback_handler.callbacks
        if self not in callbacks:
            callbacks.insert(0, self)
        return self

    def checkpoint_state(self) -> dict[str, Any]:
        """Saved with every checkpoint, so an alarm active at the save is still active on the next step."""
        return {
            "tracker": self.tracker.checkpoint_state(),
            "events": [asdict(event) for event in self.events],
            "remedy_active": self.remedy_active,
            "stopped": self._stopped,
        }

    def load_checkpoint_state(self, state: dict[str, Any], args: Any = None) -> None:
        """Continue from `checkpoint_state()`: an active virtual-samples remedy is active again (a warning when
        `args` has no ``virtual_samples_attr`` field), and a run the monitor stopped is not stopped again (resuming is
        the user's decision; the alarm stays active and flagged)."""
        self.tracker.load_checkpoint_state(state["tracker"])
        self.events = [HealthEvent(**event) for event in state["events"]]
        self.remedy_active = state["remedy_active"]
        self._stopped = state["stopped"]
        attr = self.config.virtual_samples_attr
        if self.remedy_active and args is not None and not hasattr(args, attr):
            logger.warning(
                "[health] the checkpoint has the virtual-samples remedy on, but these trainer arguments have no %r "
                "field: it has no effect in this run (use trl_stable.GRPOConfig).",
                attr,
            )

    def _drop_records_after(self, step: int) -> None:
        """Remove the health file's records of steps after `step` (and a half-written line): a run resumed from the
        checkpoint of `step` redoes them."""
        if self.health_path is None or not os.path.isfile(self.health_path):
            return

        def later(line: str) -> bool:
            try:
                record = json.loads(line)
            except ValueError:  # a line cut short by the kill
                return True
            return isinstance(record, dict) and int(record.get("step") or 0) > step

        with open(self.health_path, encoding="utf-8") as f:
            lines = f.readlines()
        kept = [line if line.endswith("\n") else line + "\n" for line in lines if not later(line)]
        dropped = len(lines) - len(kept)
        if not dropped:
            return
        tmp = self.health_path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.replace(tmp, self.health_path)
        except OSError as err:
            logger.warning("[health] cannot rewrite %s (%s); the health file is switched off.", self.health_path, err)
            self.health_path = None
            return
        logger.info(
            "[health] resumed at step %d: dropped %d later record(s) from %s.", step, dropped, self.health_path
        )

    def _write(self, record: dict[str, Any], mode: str = "a") -> None:
        if self.health_path is None:
            return
        # One complete line per write call, so a reader (the dashboard) never sees half a record.
        line = json.dumps(record, allow_nan=False, default=str) + "\n"
        try:
            with open(self.health_path, mode, encoding="utf-8") as f:
                f.write(line)
        except OSError as err:  # a full disk or a vanished output dir must not kill the training run
            logger.warning("[health] cannot write %s (%s); the health file is switched off.", self.health_path, err)
            self.health_path = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.tracker.max_completion_length is None:
            caps = (getattr(args, n, None) for n in ("max_completion_length", "response_length", "max_new_tokens"))
            self.tracker.max_completion_length = next((v for v in caps if isinstance(v, int) and v > 0), None)
        # PPOConfig's `target` (the KL its adaptive controller steers to, in `objective/kl`'s unit); GRPO's has none
        target = getattr(args, "target", None) if hasattr(args, "adap_kl_ctrl") else None
        if self.tracker.kl_target is None and isinstance(target, (int, float)) and not isinstance(target, bool):
            self.tracker.kl_target = float(target) if math.isfinite(target) and target > 0 else None
        if self.config.health_file and state.is_world_process_zero and getattr(args, "output_dir", None):
            os.makedirs(args.output_dir, exist_ok=True)
            self.health_path = os.path.join(args.output_dir, self.config.health_file)
            if state.global_step > 0:
                self._drop_records_after(state.global_step)
            self._write(
                {"type": "meta", "step": state.global_step, **self.tracker.meta()},
                # A fresh run starts a fresh file; a resumed one (global_step > 0) appends to its history.
                mode="w" if state.global_step == 0 else "a",
            )

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or any(str(key).startswith("eval_") for key in logs):
            return control
        step = state.global_step
        events = self.tracker.update(logs, step=step)
        if not self.tracker.last_gauges:
            return control
        self.events.extend(events)
        for event in events:
            critical = event.severity == "critical"
            level = logging.INFO if event.kind == "cleared" else logging.ERROR if critical else logging.WARNING
            if state.is_world_process_zero:
                logger.log(level, event.message())
            self._write(event.to_record())

        self._apply_virtual_samples(args, state, events)
        since = self.tracker.critical_held_since()
        limit = self.config.stop_after_critical_steps
        if limit is not None and not self._stopped and since is not None and state.global_step - since + 1 >= limit:
            self._stopped = True
            control.should_save = control.should_training_stop = True
            critical = [name for name in self.tracker.active if name in self.config.critical]
            if state.is_world_process_zero:
                logger.error(
                    f"[health] step {state.global_step}: critical alarm(s) {critical} held since step {since}: saving "
                    "a checkpoint and stopping the run."
                )
            self._write({"type": "stop", "step": state.global_step, "alarms": critical, "since": since})

        if self.config.log_to_history:
            flags = self.tracker.flags()
            if self.config.remedy_virtual_samples:
                flags["health/remedy/virtual_samples"] = float(self.remedy_active)
            logs.update(flags)
            # Trainer.log appended a copy of `logs` to the history before calling the callbacks.
            if state.log_history and state.log_history[-1].get("step") == step:
                state.log_history[-1].update(flags)
        record = {"type": "metrics", "step": step, **{k: json_number(v) for k, v in self.tracker.last_gauges.items()}}
        self._write({**record, "active": self.tracker.active})
        return control

    def summary(self) -> str:
        """One line: the alarms raised during the run and those still active."""
        raised = sorted({e.alarm for e in self.events if e.kind == "raised"})
        if not raised:
            return "[health] no alarm during the run"
        active = ", ".join(self.tracker.active) or "none"
        return f"[health] alarms raised during the run: {', '.join(raised)}; still active: {active}"

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            logger.info(self.summary())
        if self.config.dashboard_on_train_end and state.is_world_process_zero and self.health_path:
            from trl_stable.monitoring.dashboard import render_dashboard

            render_dashboard(args.output_dir, os.path.join(args.output_dir, "health_dashboard.png"))
        return control

    def _apply_virtual_samples(self, args, state, events: list[HealthEvent]) -> None:
        """Switch the virtual-samples remedy with the zero-std alarm, recording each switch as a configuration change
        (``{attr: {"before", "after"}}``) in the health file and the log; the trainer reads `remedy_active`."""
        if not self.config.remedy_virtual_samples:
            return
        attr, value = self.config.virtual_samples_attr, self.config.virtual_samples_value
        for event in events:
            on = event.kind == "raised"
            if event.alarm != "zero_std" or event.kind == "repeated" or on == self.remedy_active:
                continue
            if on and not hasattr(args, attr):
                logger.warning(
                    "[health] cannot switch on virtual samples: the trainer arguments have no %r field "
                    "(use trl_stable.GRPOConfig).",
                    attr,
                )
                continue
            self.remedy_active = on
            configured = getattr(args, attr)
            before, after = (configured, value) if on else (value, configured)
            if state.is_world_process_zero:
                switched = f"switched {'ON' if on else 'OFF'}: configuration change {attr} {before!r} -> {after!r}"
                logger.warning("[health] step %d: virtual samples %s", state.global_step, switched)
            self._write(
                {
                    "type": "remedy",
                    "step": state.global_step,
                    "kind": "remedy_on" if on else "remedy_off",
                    "remedy": "virtual_samples",
                    "config_change": {attr: {"before": before, "after": after}},
                }
            )
