"""Names of the metrics that both trainers log and the health monitor reads (TRL's ``group/name`` style), defined
once so the monitor reads PPO and GRPO alike without guessing from patterns."""

from __future__ import annotations

from collections.abc import Mapping

# The behaviour weight w = exp(logp_prox - logp_sampler) of the decoupled loss, before any clamp.
BEHAVIOUR_WEIGHT_MEAN = "behaviour_weight/mean"
BEHAVIOUR_WEIGHT_MAX = "behaviour_weight/max"
BEHAVIOUR_WEIGHT_MIN = "behaviour_weight/min"

# What an IcePop / KPop filter did: `token_filter/<filter>/<what>`.
TOKEN_FILTERS = ("icepop", "kpop")
MASKED_TOKEN_FRAC = "masked_token_frac"
MASKED_SEQ_FRAC = "masked_seq_frac"  # sequences with at least one filtered token
CLAMPED_TOKEN_FRAC = "clamped_token_frac"


def token_filter_metric(filter_name: str, what: str) -> str:
    """``token_filter/<filter_name>/<what>``, e.g. ``token_filter/icepop/masked_token_frac``."""
    return f"token_filter/{filter_name}/{what}"


# The token shares a filter removed (or clamped): the health monitor's `masked_fraction` gauge takes their maximum.
# Sequence shares are left out: with a token-level filter one masked token marks a whole sequence.
MASKED_FRACTION_KEYS = tuple(
    token_filter_metric(name, what) for name in TOKEN_FILTERS for what in (MASKED_TOKEN_FRAC, CLAMPED_TOKEN_FRAC)
)


# What trl_stable's reward functions log per call through TRL's `log_metric` hook, and how each combines across
# processes (`trl_stable.monitoring.reduction.logged_metric_stat`).
CRITIC_STEP_PREFIX = "critic/step_"  # the critic's counts of one call (`critic/step_<counter>`): summed
CRITIC_STAGE_SECONDS = "critic/stage_seconds"  # wall time of one call: the slowest process's
CRITIC_WAIT_SECONDS = "critic/wait_seconds"  # what the trainer waited for the critic: the slowest process's
ARENA_JUDGE_CALLS = "arena/judge_calls"
ARENA_FAILED_JUDGE_CALLS = "arena/failed_judge_calls"
SUMMED_LOGGED_METRICS = (ARENA_JUDGE_CALLS, ARENA_FAILED_JUDGE_CALLS)
MAX_LOGGED_METRICS = (CRITIC_STAGE_SECONDS, CRITIC_WAIT_SECONDS)

# The critic's per-call fractions: name -> (numerator counters, denominator counters), summed each; a denominator of
# 0 counts as 1. One definition for the critic (`CriticIntrinsicReward`) and for their reduction over processes,
# which recomputes them from the summed `critic/step_<counter>` counts instead of averaging the fractions.
_SPANS = ("spans_positive", "spans_negative")
CRITIC_STEP_RATIOS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "critic/critiqued_fraction": (("critiqued",), ("samples",)),
    # critiqued samples that got no intrinsic reward: a failed request or an answer that did not parse
    "critic/failed_fraction": (("failed_answers", "unparseable"), ("critiqued",)),
    "critic/request_failed_fraction": (("failed_answers",), ("critiqued",)),
    "critic/rewarded_token_fraction": (("tokens_rewarded",), ("tokens_total",)),
    "critic/spans_per_critique": (_SPANS, ("answers",)),
    "critic/unparseable_fraction": (("unparseable",), ("answers",)),
    **{
        f"critic/spans_{name}_frac": ((f"spans_{name}",), _SPANS)
        for name in ("matched", "partial", "query_only", "unmatched", "fuzzy")
    },
}


def critic_step_ratios(counts: Mapping[str, float]) -> dict[str, float]:
    """The critic's fractions (`CRITIC_STEP_RATIOS`) from its counts (counter name -> count); a fraction whose
    counters are not all in `counts` is left out."""
    out = {}
    for name, (numerators, denominators) in CRITIC_STEP_RATIOS.items():
        if all(k in counts for k in (*numerators, *denominators)):
            out[name] = sum(counts[k] for k in numerators) / max(sum(counts[k] for k in denominators), 1)
    return out
