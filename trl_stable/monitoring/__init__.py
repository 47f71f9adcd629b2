"""Training-health monitoring: the four-gauge dashboard (reward, zero-variance share, grad norm, completion length),
the sampler/trainer mismatch monitor, debounced alarms with their remedies, and the dashboard PNG
(docs/health_monitoring.md).

- [`HealthMonitor`]: a `transformers.TrainerCallback` (on by default in trl_stable's trainers, usable with any TRL
  trainer) that reads the logs and raises alarms.
- [`HealthTracker`] / [`HealthConfig`]: the rules themselves, framework-free.
- [`mismatch_stats`]: sampler vs trainer log-prob statistics (pure torch).
- [`check_retokenization`] / [`drop_mismatched`]: re-tokenization check for multi-turn runs.
- [`render_dashboard`]: the PNG; `trl-stable-dashboard OUTPUT_DIR` on the command line.
"""

from trl_stable.monitoring.alarms import ALARMS, AlarmSpec
from trl_stable.monitoring.callback import HealthMonitor, health_config_from_args
from trl_stable.monitoring.health import HealthConfig, HealthEvent, HealthTracker, extract_gauges
from trl_stable.monitoring.integration import HealthArguments, PPOHealthArguments, attach_health_monitor
from trl_stable.monitoring.mismatch import MismatchStats, mismatch_stats
from trl_stable.monitoring.retokenization import RetokenizationReport, check_retokenization, drop_mismatched


def render_dashboard(*args, **kwargs):
    """Render the health dashboard PNG; see [`trl_stable.monitoring.dashboard.render_dashboard`]."""
    # Lazy: matplotlib is only imported when a dashboard is drawn.
    from trl_stable.monitoring.dashboard import render_dashboard as _render

    return _render(*args, **kwargs)


__all__ = [
    "ALARMS",
    "AlarmSpec",
    "HealthArguments",
    "HealthConfig",
    "HealthEvent",
    "HealthMonitor",
    "HealthTracker",
    "MismatchStats",
    "PPOHealthArguments",
    "RetokenizationReport",
    "attach_health_monitor",
    "check_retokenization",
    "drop_mismatched",
    "extract_gauges",
    "health_config_from_args",
    "mismatch_stats",
    "render_dashboard",
]
