"""The critic's counters: a backend's request counters (`CriticCounters`, cumulative, thread-safe) and the reward
function's counts of one call (`StepCounts`)."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from trl_stable.rewards.critic.alignment import QUERY_ONLY, UNMATCHED

# requests: answers asked for (cache hits included); attempts: HTTP calls / generate batches made; failures: requests
# that ended without an answer; deduplicated: identical prompts that joined a request in flight; auth_errors: 401 /
# 403 (the reward stops the run at the first); cache_refused: answers the validator (the span parser) rejected;
# cache_revalidated: disk entries of another parser version the current validator accepted again.
COUNTER_NAMES = (
    "requests", "attempts", "retries", "successes", "failures", "cache_hits", "deduplicated", "timeouts",
    "rate_limited", "server_errors", "connection_errors", "bad_responses", "client_errors", "auth_errors",
    "deadline_exceeded", "cache_refused", "cache_revalidated", "prompt_tokens", "completion_tokens",
)  # fmt: skip
# The request failures by kind, for the error message of a failing run.
FAILURE_KINDS = (
    "timeouts", "rate_limited", "server_errors", "connection_errors", "bad_responses", "client_errors",
    "deadline_exceeded",
)  # fmt: skip

# samples_bounded: rows that intrinsic_reward_max_sum scaled down
STEP_COUNTER_NAMES = (
    "steps", "samples", "critiqued", "nan_env_rewards", "answers", "failed_answers", "unparseable", "spans_positive",
    "spans_negative", "spans_unlocated", "spans_matched", "spans_partial", "spans_query_only", "spans_unmatched",
    "spans_fuzzy", "answers_with_ignored_text", "tokens_total", "tokens_rewarded", "samples_bounded",
)  # fmt: skip


class CriticCounters:
    """Thread-safe cumulative counters of a critic backend (`COUNTER_NAMES`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTER_NAMES, 0)

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def restore(self, values: Mapping[str, int]) -> None:
        """Continue from a `snapshot()` (a resumed run's counters go on from the checkpoint's)."""
        with self._lock:
            self._values = {**dict.fromkeys(COUNTER_NAMES, 0), **{k: int(v) for k, v in values.items()}}


class StepCounts:
    """The reward function's counts (`STEP_COUNTER_NAMES`) of one call, or summed over calls (`add`); `record`
    counts what one `Critique` says (a failed request, an unparseable answer, or its spans and rewarded tokens)."""

    def __init__(self, **values: int) -> None:
        self.values = {**dict.fromkeys(STEP_COUNTER_NAMES, 0), **values}

    def __getitem__(self, name: str) -> int:
        return self.values[name]

    def record(self, critique: Any) -> None:
        v, parsed = self.values, critique.parsed
        if parsed is None:
            v["failed_answers"] += 1
            return
        v["answers"] += 1
        if not parsed.ok:
            v["unparseable"] += 1
            return
        v["answers_with_ignored_text"] += bool(parsed.ignored_text)
        v["spans_positive"] += len(parsed.positive)
        v["spans_negative"] += len(parsed.negative)
        for a in critique.alignments:
            v[f"spans_{a.status}"] += 1
            v["spans_unlocated"] += a.status in (QUERY_ONLY, UNMATCHED)
            v["spans_fuzzy"] += a.fuzzy
        v["samples_bounded"] += critique.bounded
        v["tokens_rewarded"] += sum(x != 0.0 for x in critique.row)

    def add(self, other: StepCounts | Mapping[str, int]) -> None:
        """Add another call's counts (or a saved mapping of them)."""
        for name, value in (other.values if isinstance(other, StepCounts) else other).items():
            self.values[name] = self.values.get(name, 0) + value
