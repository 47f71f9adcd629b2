"""How trl_stable's trainers switch the health monitor on: config fields (a dataclass mixin the configs inherit and
validate in `__post_init__`) and [`attach_health_monitor`], called at the end of the trainer's `__init__`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from trl_stable.monitoring.callback import HealthMonitor, health_config_from_args
from trl_stable.monitoring.health import HealthConfig
from trl_stable.settings.checks import Dependent, check_dependents, option


def _shortcut(name: str, help: str | None = None) -> Any:
    """The `health_<name>` trainer-argument field: `HealthConfig.<name>`'s default and, unless `help` says it for a
    trainer, its help (one definition, so the two cannot drift apart)."""
    source = HealthConfig.__dataclass_fields__[name]
    return option(source.default, help or source.metadata["help"])


@dataclass
class HealthArguments:
    """Health-monitor fields of a trl_stable trainer config (see `docs/health_monitoring.md`)."""

    health_monitor: bool = option(
        True,
        "Watch the training logs and raise alarms (health.jsonl in output_dir, `health/*` log "
        "flags). It only reads the logs: training numbers are unchanged. False switches it off.",
    )
    health_reward_max: float | None = _shortcut("reward_max")
    health_mismatch_threshold: float = _shortcut("mismatch_threshold")
    health_remedy_virtual_samples: bool = _shortcut(
        "remedy_virtual_samples",
        "GRPO: while the zero-std alarm holds (frac_reward_zero_std > 50%), compute the advantages with NGRPO virtual "
        "samples: this configuration with advantage_estimator='ngrpo', validated as a config when it is built (a "
        "combination the config refuses is refused then). The arguments are never changed; each switch is logged as "
        "a configuration change (before/after) in health.jsonl and the log.",
    )
    health_stop_after_critical_steps: int | None = _shortcut(
        "stop_after_critical_steps",
        "Save a checkpoint and stop training once a critical alarm (grad_norm_vanishing, entropy_collapse, "
        "nonfinite) has held this many steps. None: never stop.",
    )
    health_mismatch_monitor: bool = option(
        False,
        "Log the sampler/trainer log-prob mismatch (mismatch/*) on every generation batch: record "
        "the HF sampler's log-probs and recompute the trainer's when no other option does (one extra "
        "forward per batch without the decoupled loss).",
    )
    health_monitor_kwargs: dict | str | None = option(
        None,
        "Any other `trl_stable.monitoring.HealthConfig` field, as a dict (or a JSON string), e.g. "
        "{'patience': 5, 'zero_std_alarm': 0.6}.",
    )

    def validate_health_arguments(self) -> None:
        """Raise ValueError on contradictory health settings (called from the config's `__post_init__`)."""
        if isinstance(self.health_monitor_kwargs, str):
            try:
                self.health_monitor_kwargs = json.loads(self.health_monitor_kwargs)
            except json.JSONDecodeError as err:
                raise ValueError(f"health_monitor_kwargs is not valid JSON: {err}; pass a dict.") from err
        # every health_* field configures the monitor (the fields enumerated, so a new one is covered)
        settings = tuple(f.name for f in dataclasses.fields(HealthArguments) if f.name != "health_monitor")
        check_dependents(self, (Dependent(settings, self.health_monitor, "health_monitor=True"),))
        health_config_from_args(self)  # field-level validation lives in HealthConfig


@dataclass
class PPOHealthArguments(HealthArguments):
    """Health-monitor fields of the PPO config: PPO scores are often unbounded (classifier logits), so no reward
    maximum is declared by default, and there are no groups for virtual samples."""

    health_reward_max: float | None = option(
        None,
        "Declared maximum of the sequence score (env/reward_mean). None (default) disables the "
        "reward-plateau-below-maximum and reward-above-maximum alarms.",
    )

    def validate_health_arguments(self) -> None:
        if self.health_remedy_virtual_samples:
            raise ValueError(
                "health_remedy_virtual_samples=True is a GRPO remedy (NGRPO virtual samples need groups); PPO has "
                "none. Leave it False."
            )
        if self.health_mismatch_monitor:
            raise ValueError(
                "health_mismatch_monitor=True is not available in PPOTrainer: PPO logs the sampler/trainer mismatch "
                "(mismatch/*) with use_decoupled_loss=True, from the sampler's log-probs. Leave it False."
            )
        super().validate_health_arguments()


def attach_health_monitor(trainer: Any) -> HealthMonitor | None:
    """Attach a [`HealthMonitor`] built from `trainer.args` ahead of the other callbacks; None when switched off.

    Works for any trainer with `args` and a `callback_handler` (transformers' `Trainer`, trl_stable's PPOTrainer).
    """
    config = health_config_from_args(trainer.args)
    return None if config is None else HealthMonitor(config).attach(trainer)
