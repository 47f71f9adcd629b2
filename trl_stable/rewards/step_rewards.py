"""Intermediate step rewards for agent tasks: one agent step scored against the ground-truth step on tool name,
arguments, reasoning and plan, each in [0, 1], weighted to sum to exactly 1.0 for a perfect answer, plus penalties;
each dimension is also its own reward function for GDPO (dimensions, weights, penalties: docs/agent_steps.md).
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trl_stable.masking.validation import (
    ARGUMENT_KEYS,
    NAME_KEYS,
    ParsedToolCall,
    find_tool_call_spans,
    parse_tool_call,
)
from trl_stable.rewards.arena import completion_text
from trl_stable.settings.checks import option

DIMENSIONS = ("tool_name", "arguments", "reasoning", "plan")

DEFAULT_CONNECTIVES = (
    "first", "then", "because", "therefore", "so that", "since", "thus", "hence", "next", "finally", "after that",
    "as a result", "which means", "首先", "然后", "因为", "所以", "因此", "接着", "最后", "由于",
)  # fmt: skip

_SECTION = re.compile(
    r"^\s*(thought|thinking|reasoning|plan|action input|action|final answer|answer)\s*[:：]", re.IGNORECASE | re.M
)
WEIGHT_SUM_TOLERANCE = 1e-9


def _is_weight(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


@dataclass
class StepRewardWeights:
    """Weights of the step-reward dimensions; they must sum to 1 so a perfect answer scores exactly 1.0.

    A sum within `WEIGHT_SUM_TOLERANCE` (1e-9) of 1 is accepted and the weights are rescaled by it; anything further
    off is a ValueError.
    """

    tool_name: float = option(0.5, "Weight of the tool-name match.")
    arguments: float = option(0.2, "Weight of the argument key-value match.")
    reasoning: float = option(0.2, "Weight of the reasoning quality.")
    plan: float = option(0.1, "Weight of the plan completeness.")

    def __post_init__(self):
        values = self.as_dict()
        bad = {k: v for k, v in values.items() if not _is_weight(v)}
        if bad:
            raise ValueError(f"Step-reward weights must be finite real numbers >= 0; fix {bad}.")
        total = math.fsum(values.values())
        if abs(total - 1.0) > WEIGHT_SUM_TOLERANCE:
            raise ValueError(
                f"Step-reward weights {values} sum to {total!r}, so a perfect answer would score {total!r}, not 1.0. "
                "Fix: scale them to sum to 1 (e.g. tool_name=0.5, arguments=0.2, reasoning=0.2, plan=0.1)."
            )
        # Within the tolerance (decimal weights such as 0.1 are not exact in binary), rescale so the sum is 1 up to
        # one rounding: the total's rounding to 12 decimals then makes a perfect answer exactly 1.0.
        for name, value in values.items():
            setattr(self, name, float(value) / total)

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in DIMENSIONS}


@dataclass
class AgentStep:
    """A completion read as one agent step: its tool calls (in order), thought, plan items and raw text."""

    calls: list[ParsedToolCall] = field(default_factory=list)
    invalid_calls: int = 0
    thought: str = ""
    plan: list[str] = field(default_factory=list)
    text: str = ""


@dataclass
class PenaltyRule:
    """A targeted penalty: when ``applies(step, ground_truth, prompt)`` is true, `penalty` (<= 0) is added.

    Args:
        name: Shown in the per-dimension scores as ``penalty/<name>``.
        penalty: The amount added, <= 0 (a bonus would let a perfect answer exceed 1.0).
        applies: ``f(step: AgentStep, ground_truth, prompt_text: str) -> bool``.
    """

    name: str
    penalty: float
    applies: Callable[[AgentStep, Any, str], bool]

    def __post_init__(self):
        if not (math.isfinite(self.penalty) and self.penalty <= 0):
            raise ValueError(
                f"Penalty {self.name!r} is {self.penalty}; penalties must be <= 0 so the maximum reward stays 1.0."
            )


def tool_overuse_penalty(
    tool: str, max_calls: int, penalty: float = -0.3, include_prompt: bool = False,
    open_tag: str = "<tool_call>", close_tag: str = "</tool_call>",
) -> PenaltyRule:  # fmt: skip
    """Penalise calling `tool` more than `max_calls` times (e.g. polling ``check_status`` when unsure).

    With `include_prompt`, calls already in the prompt (the trajectory so far) count too.
    """
    if max_calls < 0:
        raise ValueError(f"max_calls must be >= 0, got {max_calls}.")

    def applies(step: AgentStep, ground_truth: Any, prompt: str) -> bool:
        count = sum(call.name == tool for call in step.calls)
        if include_prompt and prompt:
            count += sum(c.name == tool for c in parse_agent_step(prompt, open_tag, close_tag).calls)
        return count > max_calls

    return PenaltyRule(f"overuse_{tool}", penalty, applies)


def invalid_call_penalty(penalty: float = -0.3) -> PenaltyRule:
    """Penalise a completion containing a tool call that does not parse as JSON."""
    return PenaltyRule("invalid_call", penalty, lambda step, gt, prompt: step.invalid_calls > 0)


def _plan_items(plan: Any) -> list[str]:
    if plan is None:
        return []
    if isinstance(plan, (list, tuple)):
        return [str(p).strip() for p in plan if str(p).strip()]
    items = re.split(r"\n|;|(?<=\.)\s+(?=\d)|(?:^|\s)\d+[.)]\s", str(plan))
    return [re.sub(r"^[-*\d.)\s]+", "", i).strip() for i in items if i and i.strip(" -*.")]


def _add_call(step: AgentStep, text: str, *tags: str) -> None:
    try:
        step.calls.append(parse_tool_call(text, *tags))
    except ValueError:
        step.invalid_calls += 1


def parse_agent_step(text: str, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>") -> AgentStep:
    """Read a completion as an agent step.

    Accepted: a JSON object (``{"thought", "plan", "tool"/"name", "arguments"/"args", "tool_calls": [...]}``), or
    text with ``Thought:`` / ``Plan:`` sections and tool calls as ``<tool_call>{json}</tool_call>`` blocks or a
    ReAct ``Action: name`` + ``Action Input: {json}`` pair. Without a ``Thought:`` header the thought is the text
    outside tool calls and the plan.
    """
    step = AgentStep(text=text)
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            step.thought = str(obj.get("thought") or obj.get("reasoning") or "")
            step.plan = _plan_items(obj.get("plan"))
            calls = obj.get("tool_calls")
            if calls is None and any(k in obj for k in NAME_KEYS):
                calls = [obj]
            for call in calls or []:
                _add_call(step, json.dumps(call))
            return step
    spans = find_tool_call_spans(text, open_tag, close_tag)
    for a, b in spans:
        _add_call(step, text[a:b], open_tag, close_tag)
    outside = text
    for a, b in reversed(spans):
        outside = outside[:a] + outside[b:]
    # ``Thought: ... Plan: ... Action: ...`` sections (ReAct style): [text before any header, header, section, ...]
    parts = _SECTION.split(outside)
    sections: dict[str, str] = {}
    for header, body in zip(parts[1::2], parts[2::2]):
        sections.setdefault(header.lower(), body.strip())  # a repeated header: its first section counts
    if "action" in sections and not spans:
        name = sections["action"].splitlines()[0].strip() if sections["action"] else ""
        # parse_tool_call decodes string arguments (blank: {}); bad JSON raises, which _add_call counts as invalid
        _add_call(step, json.dumps({"name": name, "arguments": sections.get("action input", "")}))
    step.plan = _plan_items(sections.get("plan"))
    thought = sections.get("thought", sections.get("thinking", sections.get("reasoning")))
    step.thought = (parts[0] if thought is None else thought).strip()
    return step


def _ground_truth_calls(gt: Any) -> tuple[list[dict[str, Any]], list[str], Any]:
    """(expected calls as {name, arguments}, required plan items, keywords) from a ground-truth value."""
    if isinstance(gt, str):
        gt = json.loads(gt)
    if isinstance(gt, Sequence) and not isinstance(gt, Mapping):
        gt = {"tool_calls": list(gt)}
    if not isinstance(gt, Mapping):
        raise ValueError(f"Ground truth must be a dict, a list of calls or a JSON string of one; got {gt!r}.")
    raw_calls = gt.get("tool_calls")
    if raw_calls is None:
        raw_calls = [gt] if any(gt.get(k) is not None for k in NAME_KEYS) else []
    calls = []
    for call in raw_calls:
        fn = call.get("function", call) if isinstance(call.get("function"), Mapping) else call
        name = next((fn[k] for k in NAME_KEYS if fn.get(k) is not None), None)
        args = next((fn[k] for k in ARGUMENT_KEYS if fn.get(k) is not None), {})
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        calls.append({"name": name, "arguments": dict(args or {})})
    return calls, _plan_items(gt.get("plan")), gt.get("reasoning_keywords")


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, str) and isinstance(b, str):
        return a.strip() == b.strip()
    return a == b


def _norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


class StepReward:
    """Intermediate step reward, usable as a TRL reward function.

    Args:
        weights: A `StepRewardWeights` or a dict of its fields (validated: the weights must sum to 1).
        penalties: `PenaltyRule`s (e.g. ``tool_overuse_penalty("check_status", 2)``).
        ground_truth_key: Dataset column holding each row's ground truth: ``{"tool"/"name", "arguments",
            "plan": [required items], "reasoning_keywords": [...]}``, a list of such calls, or a JSON string.
        exact_arguments: Arguments score 1 only when every key-value pair matches (default: the share matching).
        reasoning_scorer: ``f(thought) -> [0, 1]`` replacing the connective count (e.g. an LLM judge).
        connectives: Words counted as logical connectives (a row's ``reasoning_keywords`` override them).
        min_connectives: Distinct connectives needed for a full reasoning score.
        clip_min: Lower bound of the total reward (None: unbounded below).

    Calling it (``reward_funcs=[StepReward()]``) returns the weighted total; `reward_funcs` returns one function
    per dimension (plus one for the penalties) and `reward_weights` their weights, for GDPO.
    """

    def __init__(
        self,
        weights: StepRewardWeights | Mapping[str, float] | None = None,
        penalties: Sequence[PenaltyRule] = (),
        ground_truth_key: str = "ground_truth",
        exact_arguments: bool = False,
        reasoning_scorer: Callable[[str], float] | None = None,
        connectives: Sequence[str] = DEFAULT_CONNECTIVES,
        min_connectives: int = 2,
        clip_min: float | None = None,
        open_tag: str = "<tool_call>",
        close_tag: str = "</tool_call>",
    ):
        if weights is None:
            weights = StepRewardWeights()
        elif isinstance(weights, Mapping):
            unknown = set(weights) - set(DIMENSIONS)
            if unknown:
                raise ValueError(f"Unknown step-reward weight(s) {sorted(unknown)}; the dimensions are {DIMENSIONS}.")
            weights = StepRewardWeights(**weights)
        if min_connectives < 1:
            raise ValueError(f"min_connectives must be >= 1, got {min_connectives}.")
        self.weights = weights
        self.penalties = list(penalties)
        names = [p.name for p in self.penalties]
        if len(set(names)) != len(names):
            raise ValueError(f"Penalty names must be unique, got {names}.")
        self.ground_truth_key = ground_truth_key
        self.exact_arguments = exact_arguments
        self.reasoning_scorer = reasoning_scorer
        self.connectives = tuple(connectives)
        self.min_connectives = min_connectives
        self.clip_min = clip_min
        self.open_tag, self.close_tag = open_tag, close_tag
        self.__name__ = "step_reward"
        self._cache: tuple[str, list[dict[str, float] | None]] | None = None

    def score(self, completion: Any, ground_truth: Any, prompt: Any = "") -> dict[str, float]:
        """Per-dimension scores, ``penalty/<name>`` amounts, ``penalty`` (their sum) and ``total``."""
        step = parse_agent_step(completion_text(completion), self.open_tag, self.close_tag)
        expected, required_plan, keywords = _ground_truth_calls(ground_truth)
        plan = _norm(" ".join(step.plan))
        name_score, args_score = self._call_scores(step.calls, expected)
        scores = {
            "tool_name": name_score,
            "arguments": args_score,
            "reasoning": self._reasoning_score(step.thought, keywords),
            # the share of the required plan items the plan mentions
            "plan": sum(_norm(i) in plan for i in required_plan) / len(required_plan) if required_plan else 1.0,
        }
        prompt_text = completion_text(prompt)
        fired = {f"penalty/{p.name}": p.penalty for p in self.penalties if p.applies(step, ground_truth, prompt_text)}
        penalty = math.fsum(fired.values())
        # fsum + rounding: decimal weights such as 0.5 + 0.2 + 0.2 + 0.1 give exactly 1.0, not 0.9999999999999999.
        total = round(math.fsum(w * scores[d] for d, w in self.weights.as_dict().items()) + penalty, 12)
        if self.clip_min is not None:
            total = max(total, self.clip_min)
        return {**scores, **fired, "penalty": penalty, "total": total}

    def _call_scores(self, calls: Sequence[ParsedToolCall], expected: Sequence[Mapping[str, Any]]):
        """(tool-name score, argument score): calls aligned in order, both over max(#expected, #made)."""
        n = max(len(expected), len(calls))
        if n == 0:
            return 1.0, 1.0  # no call expected, none made
        name_hits, arg_total = 0, 0.0
        for call, want in zip(calls, expected):
            if call.name == want["name"]:  # arguments: matching key-value pairs / the union of keys (or all-or-none)
                name_hits += 1
                got, wanted = call.arguments, want["arguments"]
                keys = set(got) | set(wanted)
                matched = sum(k in got and k in wanted and _values_equal(got[k], wanted[k]) for k in keys)
                share = matched / len(keys) if keys else 1.0
                arg_total += float(share == 1.0) if self.exact_arguments else share
        return name_hits / n, arg_total / n

    def _reasoning_score(self, thought: str, keywords: Sequence[str] | None) -> float:
        if self.reasoning_scorer is None:  # distinct logical connectives / min_connectives, capped at 1
            low = thought.lower()
            found = sum(
                re.search(rf"\b{re.escape(c)}\b", low) is not None if c.isascii() else c in low
                for c in (c.lower() for c in keywords or self.connectives)
            )
            return min(1.0, found / self.min_connectives)
        reasoning = float(self.reasoning_scorer(thought))
        if not 0.0 <= reasoning <= 1.0:
            raise ValueError(f"reasoning_scorer returned {reasoning}; it must return a score in [0, 1].")
        return reasoning

    def _batch(self, prompts: Sequence[Any], completions: Sequence[Any], kwargs: Mapping[str, Any], key: str):
        """``score(...)[key]`` per row (None without ground truth); the last batch's scores are kept, not parsed again,
        as the per-dimension `reward_funcs` are called one after another on the same batch."""
        truths = kwargs.get(self.ground_truth_key)
        if truths is None:
            raise ValueError(
                f"StepReward needs a '{self.ground_truth_key}' dataset column (or set `ground_truth_key`); the reward "
                f"function got columns {sorted(k for k in kwargs if not k.startswith('log_'))}."
            )
        cache_key = repr((list(prompts), list(completions), list(truths)))
        if self._cache is None or self._cache[0] != cache_key:
            rows = zip(prompts, completions, truths)
            self._cache = (cache_key, [None if t is None else self.score(c, t, p) for p, c, t in rows])
        return [None if scores is None else scores[key] for scores in self._cache[1]]

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
        return self._batch(prompts, completions, kwargs, "total")

    def reward_funcs(self) -> list[Callable[..., list[float | None]]]:
        """One reward function per dimension (``step_tool_name``, ...), plus ``step_penalty`` when there are
        penalty rules; pair with `reward_weights` and ``multi_objective_aggregation="normalize_then_sum"``."""
        funcs = []
        for key in list(DIMENSIONS) + (["penalty"] if self.penalties else []):

            def func(prompts, completions, _key=key, **kwargs):
                return self._batch(prompts, completions, kwargs, _key)

            func.__name__ = f"step_{key}"
            funcs.append(func)
        return funcs

    def reward_weights(self) -> list[float]:
        """Weights aligned with `reward_funcs` (1.0 for the penalty function)."""
        return list(self.weights.as_dict().values()) + ([1.0] if self.penalties else [])
