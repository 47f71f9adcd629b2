"""`CriticIntrinsicReward`: dense per-token rewards from an LLM critic's spans (Drlc / RELC: Cao et al., "Enhancing
Reinforcement Learning with Dense Rewards from Language Model Critic", EMNLP 2024, arXiv 2401.07382)."""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trl_stable.monitoring.metric_names import (
    CRITIC_STAGE_SECONDS,
    CRITIC_STEP_PREFIX,
    CRITIC_WAIT_SECONDS,
    critic_step_ratios,
)
from trl_stable.rewards.arena import completion_text
from trl_stable.rewards.critic.alignment import (
    SpanAlignment,
    align_spans,
    decode_response,
    rewards_from_alignments,
    token_char_offsets,
)
from trl_stable.rewards.critic.backend import CriticBackend
from trl_stable.rewards.critic.config import CriticRewardConfig
from trl_stable.rewards.critic.counters import COUNTER_NAMES, FAILURE_KINDS, STEP_COUNTER_NAMES, StepCounts
from trl_stable.rewards.critic.factory import build_critic_backend, warn_ignored_backend_fields
from trl_stable.rewards.critic.jobs import CriticJob
from trl_stable.rewards.critic.parsing import PARSER_VERSION, ParsedCritique
from trl_stable.rewards.critic.templates import fill_critic_template, load_critic_template
from trl_stable.rewards.dense import RewardContractError, RewardTypeError, reward_number
from trl_stable.rewards.failure_guard import FailureGuard, RewardComponentFailure

logger = logging.getLogger(__name__)


def scale_intrinsic_rewards(row: Sequence[float], coef: float = 1.0, max_abs_sum: float | None = None) -> list[float]:
    """One sample's intrinsic token rewards times `coef`, scaled down (signs and proportions kept) so that their
    absolute sum is at most `max_abs_sum`; ``coef=1, max_abs_sum=None`` (RELC) keeps the row.

    Example:
        >>> scale_intrinsic_rewards([0.5, 0.5, -0.5, 0.5], coef=1.0, max_abs_sum=1.0)
        [0.25, 0.25, -0.25, 0.25]
    """
    scaled = [coef * float(v) for v in row]
    total = sum(abs(v) for v in scaled)
    if max_abs_sum is not None and total > max_abs_sum:
        return [v * (max_abs_sum / total) for v in scaled]
    return scaled


@functools.lru_cache(maxsize=4096)
def _parse_memo(parse: Any, answer: str, header: str | None) -> ParsedCritique:
    return parse(answer, continues=header)


def _flat(text: str) -> str:
    return " ".join(text.split())


def _nan_as_none(values: list[float] | None) -> list[float | None] | None:
    return None if values is None else [None if math.isnan(v) else v for v in values]


def _env_reward_floats(env_rewards: Sequence[Any] | None, n: int) -> list[float] | None:
    """`env_rewards` as floats, None -> NaN (such a sample is never critiqued, only counted as ``nan_env_rewards``);
    a value that is no number is refused by index."""
    if env_rewards is None:
        return None
    if len(env_rewards) != n:
        raise RewardContractError(f"env_rewards has {len(env_rewards)} entries for {n} completions; pass one each.")
    floats = []
    for i, value in enumerate(env_rewards):
        try:
            floats.append(reward_number(value, "", ""))
        except RewardTypeError:
            raise RewardTypeError(
                f"env_rewards[{i}]={value!r:.60} ({type(value).__name__}) is not a number: pass each completion's "
                "environment reward as a float (None or NaN where it has none)."
            ) from None
    return floats


def _check_completions(completions: Sequence[Any] | None, n: int) -> None:
    """Refuse, by index, a completion that is no text or message list, and a count other than `completion_ids`'."""
    if completions is None:
        return
    if len(completions) != n:
        raise RewardContractError(
            f"completions has {len(completions)} entries but completion_ids has {n}: pass the texts and the token ids "
            "of the same completions, one each."
        )
    for i, completion in enumerate(completions):
        if not isinstance(completion, (str, list, tuple)):
            raise RewardTypeError(
                f"completions[{i}]={completion!r:.60} ({type(completion).__name__}) is no completion: pass its text "
                f"(or its list of messages), the decoding of completion_ids[{i}]."
            )


class CriticFailureError(RewardComponentFailure):
    """Every critic request failed (or gave an unparseable answer) for `max_consecutive_failing_steps` consecutive
    steps, or the critic server rejected the API key (at the first step)."""


@dataclass
class Critique:
    """One critic answer on its way to token rewards (parse -> align -> reward -> scale), as far as it got: `row` is
    None for a failed request (`parsed` None) or an unparseable answer; `bounded`: `intrinsic_reward_max_sum` scaled
    it down."""

    parsed: ParsedCritique | None = None
    alignments: list[SpanAlignment] = field(default_factory=list)
    row: list[float] | None = None
    bounded: bool = False


@dataclass
class CriticPrefetch:
    """A batch whose critic requests `CriticIntrinsicReward.prefetch` started: what the later call needs to collect
    them. `matches` checks that the call is about the same batch."""

    completion_ids: list[list[int]]
    env_rewards: list[float] | None
    selected: list[int]  # the critiqued completions (env reward at or below the threshold), in job order
    prompt_texts: dict[int, str]
    aligned: dict[int, tuple[str, list[tuple[int, int]]]]  # completion index -> (decoded text, token char offsets)
    job: CriticJob | None
    started: float
    counters_before: dict[str, int]

    def matches(self, completion_ids: Sequence[Sequence[int]], env_rewards: list[float] | None) -> bool:
        ids = [[int(t) for t in c] for c in completion_ids]
        return ids == self.completion_ids and _nan_as_none(env_rewards) == _nan_as_none(self.env_rewards)


class CriticIntrinsicReward:
    """Dense reward function (`trl_stable.rewards.dense`): per-token intrinsic rewards from a critic's spans,
    ``reward(prompts, completions, completion_ids, env_rewards=None, **kwargs) -> list[list[float] | None]``.

    Completions with ``env_rewards[i] <= intrinsic_reward_threshold`` are critiqued (all when `env_rewards` is None;
    never for None or NaN, counted as ``nan_env_rewards``), the text being ``decode(completion_ids[i])``; the others
    get None. Bad arguments raise a `RewardContractError` naming the entry before any request. A failed request or an
    unparseable answer gives no reward, counted; `max_consecutive_failing_steps` steps in a row without a usable
    critique raise `CriticFailureError`.

    Args:
        config: A `CriticRewardConfig`.
        tokenizer: The policy's tokenizer.
        backend: A ready `CriticBackend`, for any `critic_task`; default built from `config` with this function's span
            parser as its answer validator.
        critic_model, critic_tokenizer: For ``critic_backend='transformers'``: a model object (e.g. the policy) to
            critique with, and its tokenizer (default `tokenizer`).
    """

    dense = True

    def __init__(
        self,
        config: CriticRewardConfig,
        tokenizer: Any = None,
        backend: CriticBackend | None = None,
        critic_model: Any = None,
        critic_tokenizer: Any = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.__name__ = f"critic_{config.critic_task}"
        self.template = (
            load_critic_template(config.resolved_prompt_file)
            if backend is not None or config.critic_backend != "lexicon" or config.prompt_file is not None
            else "{}"  # the lexicon critic annotates the raw text; a template only matters to LLM critics
        )
        # The header the template ends with, which the critic's answer continues (see `continuation_header`); the
        # filled prompt ends as the template does unless the text itself is last.
        self.answer_header = config.continuation_header(self.template)
        tail = self.template.rstrip().splitlines()[-1].strip() if self.template.strip() else ""
        if self.answer_header is None and tail.endswith(":") and "{" not in tail:
            logger.warning(
                "The critic template ends with %r, which is no answer header the parser reads; answers must then "
                "carry their own headers.",
                tail,
            )
        if backend is not None:
            warn_ignored_backend_fields(config, backend)
        elif config.use_intrinsic_reward:
            backend = build_critic_backend(
                config,
                critic_model,
                critic_tokenizer or tokenizer,
                # cache only answers that parse (with this template's continuation header): garbage is asked again
                answer_validator=lambda answer: self.parse(answer).ok,
                validator_version=f"critic_parsing/{PARSER_VERSION}",
            )
        self.backend = backend
        self.totals = StepCounts()
        self._last: dict[str, float] = {}
        name = backend.name if backend is not None else config.critic_backend
        self._guard = FailureGuard(
            f"The {name} critic", config.max_consecutive_failing_steps, "max_consecutive_failing_steps",
            error=CriticFailureError,
        )  # fmt: skip
        self._warned_off = False  # use_intrinsic_reward=False is said once, at the first call

    def __repr__(self) -> str:
        return f"CriticIntrinsicReward(task={self.config.critic_task!r}, backend={self.backend!r})"

    def parse(self, answer: str | None) -> ParsedCritique:
        """The spans of one critic answer (the config's `parse_answer`), read as the continuation of this template's
        last header; memoized: the backend's cache validator parses each answer first, the reward reads the result."""
        if not isinstance(answer, str):  # None (a failed request) or a backend's stray object: nothing to share
            return self.config.parse_answer(answer, continues=self.answer_header)
        return _parse_memo(self.config.parse_answer, answer, self.answer_header)

    def critic_prompt(self, prompt_text: str, completion_text: str, env_reward: float | None) -> str:
        """The critic prompt of one sample (newlines flattened as RELC did, so one-line answer formats hold)."""
        text = (prompt_text + completion_text) if self.config.critic_include_prompt else completion_text
        prompt, completion = _flat(prompt_text), _flat(completion_text)
        return fill_critic_template(self.template, _flat(text), prompt=prompt, completion=completion, score=env_reward)

    def _tokenizer(self, kwargs: dict[str, Any]) -> Any:
        tokenizer = self.tokenizer or kwargs.get("processing_class") or kwargs.get("tokenizer")
        if tokenizer is None:
            raise ValueError("CriticIntrinsicReward needs the policy tokenizer: CriticIntrinsicReward(config, tok).")
        return tokenizer

    def prefetch(
        self,
        prompts: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        env_rewards: Sequence[float] | None = None,
        **kwargs: Any,
    ) -> CriticPrefetch | None:
        """Start the critic requests now and return at once (the prefetch protocol of `trl_stable.rewards.dense`); the
        later call given ``prefetched=`` the result collects them, so each answer is paid once. That call must see
        the same completions and `env_rewards`, else it warns and asks afresh. None for synchronous backends."""
        if not self.config.use_intrinsic_reward or self.backend is None or not self.backend.concurrent:
            return None
        _check_completions(kwargs.get("completions"), len(completion_ids))
        env = _env_reward_floats(env_rewards, len(completion_ids))
        return self._start(self._tokenizer(kwargs), prompts, completion_ids, env)

    def _start(
        self, tokenizer, prompts, completion_ids, env_rewards: list[float] | None, wait_sent: bool = False
    ) -> CriticPrefetch:
        """Select the batch, submit its critic prompts and compute the token offsets while it answers; `wait_sent`:
        once the requests are on the wire (earlier, the offsets would hold the GIL the worker threads send with)."""
        started = time.monotonic()
        before = self.backend.counters.snapshot()
        # A NaN environment reward is never <= the threshold: not critiqued, only counted (critic/nan_env_rewards).
        ids = [[int(t) for t in c] for c in completion_ids]
        scores = env_rewards if env_rewards is not None else [None] * len(ids)
        selected = [i for i, r in enumerate(scores) if r is None or r <= self.config.intrinsic_reward_threshold]
        texts = {i: decode_response(tokenizer, ids[i]) for i in selected}
        prompt_texts = {i: completion_text(prompts[i]) if prompts is not None else "" for i in selected}
        critic_prompts = [self.critic_prompt(prompt_texts[i], texts[i], scores[i]) for i in selected]
        job = self.backend.submit(critic_prompts, texts=[texts[i] for i in selected]) if selected else None
        if wait_sent and job is not None:
            job.wait_sent()
        aligned = {i: token_char_offsets(tokenizer, ids[i]) for i in selected}
        return CriticPrefetch(ids, env_rewards, selected, prompt_texts, aligned, job, started, before)

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        env_rewards: Sequence[float] | None = None,
        prefetched: CriticPrefetch | None = None,
        **kwargs: Any,
    ) -> list[list[float] | None]:
        n = len(completion_ids)
        if not self.config.use_intrinsic_reward or self.backend is None:
            if not self._warned_off:
                self._warned_off = True
                logger.warning(
                    "%s was called with use_intrinsic_reward=False: it gives no intrinsic reward (None rows) and asks "
                    "no critic. Set use_intrinsic_reward=True (--use_intrinsic_reward), or leave it out of "
                    "reward_funcs.",
                    self.__name__,
                )
            return [None] * n
        waited_from = time.monotonic()
        _check_completions(completions, n)
        env_rewards = _env_reward_floats(env_rewards, n)
        if prefetched is not None and not prefetched.matches(completion_ids, env_rewards):
            logger.warning(
                "The critic call got other completions or env_rewards than its prefetch; asking the critic again "
                "(the prefetched answers are in the cache). Pass the prefetch the call's own arguments."
            )
            prefetched = None
        tokenizer = self._tokenizer(kwargs)
        # A prefetch returns at once (its caller has work to overlap); here nothing does until the answers arrive.
        batch = prefetched or self._start(tokenizer, prompts, completion_ids, env_rewards, wait_sent=True)
        step = StepCounts(
            steps=1,
            samples=n,
            critiqued=len(batch.selected),
            nan_env_rewards=sum(math.isnan(r) for r in env_rewards or ()),
            tokens_total=sum(len(c) for c in completion_ids),
        )
        rows: list[list[float] | None] = [None] * n
        # Each answer is parsed and aligned as it arrives, while the later ones are still in flight.
        for k, answer in batch.job.as_completed() if batch.job is not None else ():
            i = batch.selected[k]
            context = batch.prompt_texts[i] if self.config.critic_include_prompt else ""
            critique = self._critique(answer, *batch.aligned[i], context=context)
            step.record(critique)
            rows[i] = critique.row
        self._end_step(step, batch, waited_from, kwargs.get("log_metric"))
        return rows

    def _critique(self, answer: str | None, text: str, offsets: list[tuple[int, int]], context: str = "") -> Critique:
        """parse -> align -> reward -> scale, for one answer. Spans are located in `context` (the prompt the critic
        read before the completion) + `text`; only the completion's tokens are rewarded."""
        if answer is None:
            return Critique()
        parsed = self.parse(answer)
        if not parsed.ok:
            logger.debug("Unparseable critic answer (%s)", parsed.reason)
            return Critique(parsed)
        cfg = self.config
        positive = align_spans(text, parsed.positive, context, cfg.fuzzy_threshold)
        negative = align_spans(text, parsed.negative, context, cfg.fuzzy_threshold)
        values = cfg.positive_reward_value, cfg.negative_reward_value, cfg.outside_span_reward_value
        raw = rewards_from_alignments(offsets, positive, negative, *values)
        coef, bound = cfg.intrinsic_reward_coef, cfg.intrinsic_reward_max_sum
        bounded = bound is not None and sum(abs(coef * v) for v in raw) > bound
        return Critique(parsed, positive + negative, scale_intrinsic_rewards(raw, coef, bound), bounded)

    @property
    def consecutive_failing_steps(self) -> int:
        """Steps in a row in which no critique was usable."""
        return self._guard.consecutive

    def _end_step(self, step: StepCounts, batch: CriticPrefetch, waited_from: float, log_metric: Any) -> None:
        """Count and log the step; warn about unusable answers; stop the run on a rejected key or after
        `max_consecutive_failing_steps` steps without a usable critique (the error names the failures by kind)."""
        now = time.monotonic()
        self.totals.add(step)
        after = self.backend.counters.snapshot()
        # the fractions from one table, which the trainers also use to recompute them from the counts of every
        # process; every backend counter is logged per step, so a failing critic shows in the training logs
        self._last = last = {
            **critic_step_ratios(step.values),
            CRITIC_STAGE_SECONDS: now - batch.started,  # from the requests' start (prefetch included) to the rewards
            CRITIC_WAIT_SECONDS: now - waited_from,  # the trainer's wait here: the critic's cost after the overlap
            **{f"{CRITIC_STEP_PREFIX}{k}": after.get(k, 0) - batch.counters_before.get(k, 0) for k in COUNTER_NAMES},
            **{f"{CRITIC_STEP_PREFIX}{k}": v for k, v in step.values.items() if k != "steps"},
        }
        if callable(log_metric):  # TRL's GRPOTrainer hands reward functions this hook; values average per log
            for name, value in last.items():
                log_metric(name, float(value))
        fatal = self.backend.fatal_error() if hasattr(self.backend, "fatal_error") else None
        if fatal is not None:  # a rejected key fails every later step too: stop now, not after N paid steps
            raise CriticFailureError(fatal)
        failed, unparseable = step["failed_answers"], step["unparseable"]
        if unparseable:
            logger.warning(
                "%d of %d critic answers had no recognisable span format (their samples get no intrinsic reward; "
                "critic/unparseable_fraction).",
                unparseable,
                step["answers"],
            )
        if step["answers_with_ignored_text"]:
            logger.warning(
                "%d critic answers had spans before their first header, which were ignored: the prompt seems to end "
                "with a header the parser was not told about (critic/answers_with_ignored_text).",
                step["answers_with_ignored_text"],
            )
        if not step["critiqued"]:  # a step that critiques nothing says nothing about the critic
            return
        if failed + unparseable < step["critiqued"]:
            self._guard.record(False)
            return
        counts = {k: int(last[f"{CRITIC_STEP_PREFIX}{k}"]) for k in FAILURE_KINDS}
        kinds = ", ".join(f"{k} {v}" for k, v in counts.items() if v)
        parts = [f"{failed} failed requests" + (f" ({kinds})" if kinds else "")] if failed else []
        parts += [f"{unparseable} unparseable answers"] if unparseable else []
        fix = (
            "The server answers, but not in the span format of the prompt: check critic_model, prompt_file and "
            "critic_max_tokens (a cut-off answer does not parse)"
            if unparseable and not failed
            else "Check critic_base_url / critic_model and that the server is up"
        )
        self._guard.record(True, ", ".join(parts), fix)

    @property
    def last_metrics(self) -> dict[str, float]:
        """The last call's metrics (fractions, stage and wait seconds, ``critic/step_<counter>`` counts)."""
        return dict(self._last)

    def metrics(self) -> dict[str, float]:
        """Cumulative counters (the backend's and this function's), the last step's values as ``critic/last_...``
        and ``critic/consecutive_failing_steps``, all floats (listed in docs/critic_rewards.md, "Logged metrics")."""
        out = self.backend.metrics() if self.backend is not None else {}
        totals = self.totals.values
        out.update({f"critic/{k}": float(v) for k, v in totals.items()})
        out["critic/rewarded_token_fraction"] = totals["tokens_rewarded"] / max(totals["tokens_total"], 1)
        out.update({k.replace("critic/", "critic/last_"): float(v) for k, v in self._last.items()})
        out["critic/consecutive_failing_steps"] = float(self.consecutive_failing_steps)
        return out

    def checkpoint_state(self) -> dict[str, Any]:
        """The cumulative counts (this function's and its backend's), the last step's metrics and the failing-step
        count, for a checkpoint: trl_stable's trainers save it and restore it on resume, so the counters go on."""
        return {
            "counts": dict(self.totals.values),
            "last": dict(self._last),
            "consecutive_failing_steps": self.consecutive_failing_steps,
            "backend_counters": self.backend.counters.snapshot() if self.backend is not None else None,
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Continue from `checkpoint_state()`'s output."""
        self.totals = StepCounts(**{k: int(v) for k, v in state["counts"].items() if k in STEP_COUNTER_NAMES})
        self._last = dict(state["last"])
        self._guard.consecutive = int(state["consecutive_failing_steps"])
        if self.backend is not None and state["backend_counters"] is not None:
            self.backend.counters.restore(state["backend_counters"])

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()


def make_intrinsic_reward(config: CriticRewardConfig, tokenizer: Any, **kwargs: Any) -> CriticIntrinsicReward:
    """Shorthand for ``CriticIntrinsicReward(config, tokenizer, **kwargs)``."""
    return CriticIntrinsicReward(config, tokenizer, **kwargs)
