"""Training-health monitoring: debounced alarms with their remedies, the sampler/trainer mismatch and
re-tokenization checks, and the dashboard PNG (docs/health_monitoring.md)."""

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
