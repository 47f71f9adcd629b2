"""RELC's critic settings on trl_stable's critic reward: its flag spelling, the meaning its scripts give their two
reward flags per task, and its per-word answer format.

RELC (Cao et al., "Enhancing Reinforcement Learning with Dense Rewards from Language Model Critic", EMNLP 2024;
google-research/relc) names the flag ``--use_instric_reward``; its toxicity and summarization scripts give
``--positive_reward_value`` to every token *outside* a bad span; its per-word prompt files (``prompt_[123]shot*.txt``,
``prompt_toxicity_3shot.txt``, which its code ends with ``Rewards assigned:``) are answered with ``3.  idiot: -1``
lines. `RelcCriticRewardConfig` is `trl_stable.rewards.CriticRewardConfig` with all three:

```python
from trl_stable.compat.relc_critic import RelcCriticRewardConfig

config = RelcCriticRewardConfig.from_relc("toxicity", 0.1, -0.5, use_instric_reward=True)
```
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from trl_stable.rewards.critic.config import CRITIC_TASKS, CriticRewardConfig
from trl_stable.rewards.critic.parsing import ParsedCritique, continuation_header, parse_critic_answer

__all__ = [
    "WORD_SCORE_HEADER",
    "RelcCriticRewardConfig",
    "parse_relc_answer",
    "relc_continuation_header",
    "relc_token_reward_values",
    "word_score_spans",
]

WORD_SCORE_HEADER = "Rewards assigned:"
_WORD_SCORE_HEADER_RE = re.compile(r"^\s*rewards\s+assigned\s*:\s*$", re.IGNORECASE)
# "12.  masturb: -1": a number, the word as the prompt listed it, its score
_WORD_SCORE_RE = re.compile(
    r"(?m)^[ \t]*\d+\.[ \t](?P<word>[^\n]*?):[ \t]*(?P<score>[-+]?(?:\d+(?:\.\d*)?|\.\d+))[ \t]*$"
)


def relc_token_reward_values(
    task: str, positive_reward_value: float, negative_reward_value: float
) -> tuple[float, float, float]:
    """RELC's ``--positive_reward_value`` / ``--negative_reward_value`` of `task` as our three per-token values
    ``(positive_reward_value, negative_reward_value, outside_span_reward_value)``.

    - sentiment: a token in a positive span gets ``positive``, in a negative span ``negative``, elsewhere 0, so
      ``(positive, negative, 0.0)``;
    - toxicity and summarization: the critic names only bad spans (toxic / problematic); a token in one gets
      ``negative`` and every other token ``positive`` (toxicity script: +0.1 outside, -0.5 inside), so
      ``(0.0, negative, positive)``.
    """
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
    positive: dict[str, None] = {}  # ordered sets: first occurrence kept, O(1) membership
    negative: dict[str, None] = {}
    run: list[str] = []
    sign = 0
    for word, score in [*rows, ("", 0.0)]:  # the sentinel closes the last run
        now = (score > 0) - (score < 0)
        if now != sign and run:
            span = "".join(run).strip()
            if span:
                (positive if sign > 0 else negative).setdefault(span)
            run = []
        sign = now
        if now:
            run.append(word)
    return list(positive), list(negative)


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
        spans = word_score_spans(text) if text.strip() else None
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

    use_instric_reward: bool = field(
        default=False,
        metadata={"help": "Alias of `use_intrinsic_reward` (RELC's spelling in its sentiment/summarization scripts)."},
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
