"""RELC's critic on trl_stable: `query_batch_span` (the fork's critic call) with its failure semantics, and
`RelcCriticRewardConfig`: `trl_stable.rewards.CriticRewardConfig` with RELC's flag spelling (``--use_instric_reward``),
the meaning its scripts give their two reward flags per task, and its per-word answer format (``3.  idiot: -1`` lines
after ``Rewards assigned:``). docs/coming_from_relc.md and docs/critic_rewards.md hold the rules.
"""

from __future__ import annotations

import itertools
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trl_stable.rewards.critic.config import CRITIC_TASKS, CriticRewardConfig
from trl_stable.rewards.critic.openai_critic import OpenAICritic
from trl_stable.rewards.critic.parsing import ParsedCritique, continuation_header, parse_critic_answer
from trl_stable.settings.checks import option

__all__ = [
    "FAILED_CALLS_ENV",
    "WORD_SCORE_HEADER",
    "RelcCriticRewardConfig",
    "parse_relc_answer",
    "query_batch_span",
    "relc_continuation_header",
    "relc_token_reward_values",
    "word_score_spans",
]

FAILED_CALLS_ENV = "TRL_STABLE_RELC_FAILED_CALLS"
WORD_SCORE_HEADER = "Rewards assigned:"
_WORD_SCORE_HEADER_RE = re.compile(r"^\s*rewards\s+assigned\s*:\s*$", re.IGNORECASE)
# "12.  masturb: -1": a number, the word as the prompt listed it, its score
_WORD_SCORE_RE = re.compile(
    r"(?m)^[ \t]*\d+\.[ \t](?P<word>[^\n]*?):[ \t]*(?P<score>[-+]?(?:\d+(?:\.\d*)?|\.\d+))[ \t]*$"
)


def relc_token_reward_values(
    task: str, positive_reward_value: float, negative_reward_value: float
) -> tuple[float, float, float]:
    """RELC's ``--positive_reward_value`` / ``--negative_reward_value`` of `task` as our ``(positive_reward_value,
    negative_reward_value, outside_span_reward_value)``: sentiment ``(positive, negative, 0.0)``; toxicity and
    summarization, whose critic names only bad spans, ``(0.0, negative, positive)``."""
    if task not in CRITIC_TASKS:
        raise ValueError(f"task must be one of {CRITIC_TASKS}, got {task!r}.")
    if task == "sentiment":
        return float(positive_reward_value), float(negative_reward_value), 0.0
    return 0.0, float(negative_reward_value), float(positive_reward_value)


def word_score_spans(text: str) -> tuple[list[str], list[str]] | None:
    """Spans of a per-word answer: each run of consecutive words scored above (below) zero is one positive
    (negative) span, the words joined as listed (RELC lists tokens: " masturb" + "ating" -> "masturbating");
    None when `text` has no ``N. word: score`` line."""
    rows = [(m.group("word"), float(m.group("score"))) for m in _WORD_SCORE_RE.finditer(text)]
    if not rows:
        return None
    spans: dict[int, dict[str, None]] = {1: {}, -1: {}}  # ordered sets: first occurrence kept, O(1) membership
    for sign, run in itertools.groupby(rows, key=lambda row: (row[1] > 0) - (row[1] < 0)):
        span = "".join(word for word, _ in run).strip()
        if sign and span:
            spans[sign].setdefault(span)
    return list(spans[1]), list(spans[-1])


def relc_continuation_header(prompt: str | None) -> str | None:
    """`trl_stable.rewards.critic.parsing.continuation_header`, plus RELC's ``Rewards assigned:``."""
    last = prompt.rstrip().splitlines()[-1] if prompt and prompt.strip() else ""
    return last.strip() if _WORD_SCORE_HEADER_RE.match(last) else continuation_header(prompt)


def parse_relc_answer(answer: str | None, continues: str | None = None) -> ParsedCritique:
    """`parse_critic_answer`, plus RELC's per-word format: after ``Rewards assigned:``, or when an answer has no
    span structure but ``N. word: score`` lines."""
    if not isinstance(answer, str):
        return parse_critic_answer(answer, continues)
    text = answer.replace("\r\n", "\n").replace("\r", "\n")
    if continues and _WORD_SCORE_HEADER_RE.match(continues):
        spans = word_score_spans(text)  # None for a blank answer too
        if spans is None:
            return ParsedCritique(ok=False, reason=f"no per-word scores after {WORD_SCORE_HEADER!r}")
        return ParsedCritique(positive=spans[0], negative=spans[1])
    parsed = parse_critic_answer(answer, continues)
    if parsed.ok:
        return parsed
    spans = word_score_spans(text)
    if spans is not None and (spans[0] or spans[1] or len(_WORD_SCORE_RE.findall(text)) >= 2):
        return ParsedCritique(positive=spans[0], negative=spans[1])
    return parsed


@dataclass
class RelcCriticRewardConfig(CriticRewardConfig):
    """`CriticRewardConfig` with RELC's flag spelling (``--use_instric_reward``), its token-reward meaning per task
    (`from_relc`) and its per-word answer format (`parse_relc_answer`)."""

    use_instric_reward: bool = option(
        False, "Alias of `use_intrinsic_reward` (RELC's spelling in its sentiment/summarization scripts)."
    )

    continuation_header = staticmethod(relc_continuation_header)
    parse_answer = staticmethod(parse_relc_answer)

    def __post_init__(self) -> None:
        if self.use_instric_reward:
            self.use_intrinsic_reward = True
        super().__post_init__()

    @classmethod
    def from_relc(
        cls, task: str, positive_reward_value: float, negative_reward_value: float, **kwargs: Any
    ) -> RelcCriticRewardConfig:
        """A config whose token rewards are RELC's for `task` given RELC's two flag values
        (`relc_token_reward_values`); `kwargs` are the other fields.

        Example:
            >>> cfg = RelcCriticRewardConfig.from_relc("toxicity", 0.1, -0.5)
            >>> (cfg.positive_reward_value, cfg.negative_reward_value, cfg.outside_span_reward_value)
            (0.0, -0.5, 0.1)
        """
        pos, neg, outside = relc_token_reward_values(task, positive_reward_value, negative_reward_value)
        return cls(
            critic_task=task,
            positive_reward_value=pos,
            negative_reward_value=neg,
            outside_span_reward_value=outside,
            **kwargs,
        )


_warned: set[str] = set()
_failed_prompts: list[str] = []  # the prompts of the calls that failed since the last PPOTrainer.step (this process)


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


def take_failed_prompts() -> list[str]:
    """The prompts of the critic calls that failed since the last call, and forget them (`PPOTrainer.step` drops
    their samples with ``TRL_STABLE_RELC_FAILED_CALLS=drop``)."""
    taken = list(_failed_prompts)
    _failed_prompts.clear()
    return taken


def query_batch_span(
    queries: Sequence[str],
    max_workers: int = 2,
    max_tokens: int = 600,
    api_key: str | None = None,
    *,
    model: str = "gpt-3.5-turbo",
    base_url: str | None = None,
    timeout: float = 30.0,
    failed_as: str | None = None,
    failed_calls: str | None = None,
) -> list[str | None]:
    """`trl.extras.openai_scores.query_batch_span`: each prompt's answer from an OpenAI-compatible critic
    (temperature 0, trl_stable's `OpenAICritic`: retries, timeouts, never raises), in order; a call that failed after
    its retries is `failed_as`. What RELC's parsers make of that, and ``failed_calls="drop"``, which leaves its sample
    out of the next `PPOTrainer.step`: docs/coming_from_relc.md, "A failed critic call".

    Args:
        queries: The full critic prompts.
        max_workers: Requests in flight at once.
        max_tokens: Answer length limit.
        api_key: The key; default the environment variable OPENAI_API_KEY.
        model: The critic model (the fork hard-coded gpt-3.5-turbo).
        base_url: An OpenAI-compatible server (vLLM, ...); default the environment variable OPENAI_BASE_URL, else
            OpenAI.
        timeout: Seconds per HTTP request.
        failed_as: What a failed call returns (see above).
        failed_calls: ``"keep"`` (the sample trains on what its parser makes of `failed_as`) or ``"drop"``; default
            ``TRL_STABLE_RELC_FAILED_CALLS``, else ``"keep"``.
    """
    mode = failed_calls or os.environ.get(FAILED_CALLS_ENV) or "keep"
    if mode not in ("keep", "drop"):
        raise ValueError(f"failed_calls ({FAILED_CALLS_ENV}) must be 'keep' or 'drop', got {mode!r}.")
    _warn_once(
        "substring",
        "RELC's scripts turn critic spans into token rewards by substring matching decoded tokens (`token in "
        "span`), which also marks short tokens that merely occur inside a span (e.g. 'a', ','). trl_stable keeps "
        "your script's rewards as they are; for character-offset alignment use "
        "trl_stable.rewards.span_token_rewards, or trl_stable.rewards.make_intrinsic_reward with PPOTrainer.train().",
    )
    with OpenAICritic(
        model=model,
        # read here too: with a server and no key, OpenAICritic sends a placeholder key instead of refusing
        base_url=base_url or os.environ.get("OPENAI_BASE_URL") or None,
        api_key=api_key,
        max_tokens=max_tokens,
        concurrency=max_workers,
        timeout=timeout,
        temperature=0.0,
    ) as critic:
        answers = critic.generate(list(queries))
    failed = [q for q, a in zip(queries, answers) if a is None]
    if failed and mode == "drop":
        _failed_prompts.extend(failed)
    elif failed:
        _warn_once(
            "failed_call",
            f"query_batch_span: {len(failed)} of {len(answers)} critic calls failed after retries; they are returned "
            f"as {failed_as!r}. Under RELC's toxicity parser None means no intrinsic reward and '' the reward of a "
            "flawless answer; its sentiment and summarization parsers stop on None. "
            f"{FAILED_CALLS_ENV}=drop leaves those samples out of the PPO step instead (see query_batch_span).",
        )
    return [failed_as if a is None else a for a in answers]
