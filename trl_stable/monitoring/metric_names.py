"""Names of the metrics that both trainers log and the health monitor reads: defined once, imported everywhere.

TRL's naming style (``group/name``). A trainer that logs one of these concepts uses these names, so the monitor
reads PPO and GRPO alike without guessing from patterns.
"""

from __future__ import annotations

__all__ = [
    "BEHAVIOUR_WEIGHT_MAX",
    "BEHAVIOUR_WEIGHT_MEAN",
    "BEHAVIOUR_WEIGHT_MIN",
    "CLAMPED_TOKEN_FRAC",
    "MASKED_FRACTION_KEYS",
    "MASKED_SEQ_FRAC",
    "MASKED_TOKEN_FRAC",
    "MISMATCH_ABS_DIFF_MAX",
    "MISMATCH_ABS_DIFF_MEAN",
    "TOKEN_FILTERS",
    "token_filter_metric",
]

# The behaviour weight w = exp(logp_prox - logp_sampler) of the decoupled loss, before any clamp.
BEHAVIOUR_WEIGHT_MEAN = "behaviour_weight/mean"
BEHAVIOUR_WEIGHT_MAX = "behaviour_weight/max"
BEHAVIOUR_WEIGHT_MIN = "behaviour_weight/min"

# What an IcePop / KPop filter did: `token_filter/<filter>/<what>`.
TOKEN_FILTERS = ("icepop", "kpop")
MASKED_TOKEN_FRAC = "masked_token_frac"
MASKED_SEQ_FRAC = "masked_seq_frac"  # sequences with at least one filtered token
CLAMPED_TOKEN_FRAC = "clamped_token_frac"

# Sampler / trainer log-prob mismatch (`monitoring.mismatch.MismatchStats.as_metrics`).
MISMATCH_ABS_DIFF_MEAN = "mismatch/logp_abs_diff/mean"
MISMATCH_ABS_DIFF_MAX = "mismatch/logp_abs_diff/max"


def token_filter_metric(filter_name: str, what: str) -> str:
    """``token_filter/<filter_name>/<what>``, e.g. ``token_filter/icepop/masked_token_frac``."""
    return f"token_filter/{filter_name}/{what}"


# The token shares a filter removed (or clamped): the health monitor's `masked_fraction` gauge takes their maximum.
# Sequence shares are left out: with a token-level filter one masked token marks a whole sequence.
MASKED_FRACTION_KEYS = tuple(
    token_filter_metric(name, what) for name in TOKEN_FILTERS for what in (MASKED_TOKEN_FRAC, CLAMPED_TOKEN_FRAC)
)
