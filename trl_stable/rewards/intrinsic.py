"""Dense intrinsic rewards from an LLM critic (Drlc / RELC: Cao et al., "Enhancing Reinforcement Learning with Dense
Rewards from Language Model Critic", EMNLP 2024, arXiv 2401.07382).

For each completion whose environment reward is at most `intrinsic_reward_threshold`, a critic reads a few-shot
prompt with the text and names good and bad spans; token t of the completion then gets

    r_t^intr = positive_reward_value * [t in a positive span] + negative_reward_value * [t in a negative span]
             + outside_span_reward_value * [t in no span]

which the trainers add to their per-token rewards (PPO: to -KL + score; GRPO: through the dense-advantage path).
`intrinsic_reward_coef` and `intrinsic_reward_max_sum` scale a sample's row (`scale_intrinsic_rewards`; RELC: 1 and
no bound). `CriticIntrinsicReward` is a dense reward function in the sense of `trl_stable.rewards.dense`.
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl_stable.config_checks import Bound, Dependent, check_all_finite, check_bounds, check_dependents
from trl_stable.monitoring.metric_names import (
    CRITIC_STAGE_SECONDS,
    CRITIC_STEP_PREFIX,
    CRITIC_WAIT_SECONDS,
    critic_step_ratios,
)
from trl_stable.redaction import check_env_var_name
from trl_stable.rewards.critic_backends import (
    COUNTER_NAMES,
    SENTIMENT_LEXICONS,
    CriticBackend,
    CriticJob,
    LexiconCritic,
    OpenAICritic,
    TransformersCritic,
)
from trl_stable.rewards.critic_parsing import PARSER_VERSION, continuation_header, parse_critic_answer
from trl_stable.rewards.span_alignment import (
    MATCHED,
    PARTIAL,
    QUERY_ONLY,
    UNMATCHED,
    align_spans,
    decode_response,
    import_rapidfuzz,
    rewards_from_alignments,
    token_char_offsets,
)

logger = logging.getLogger(__name__)

CRITIC_TASKS = ("sentiment", "toxicity", "summarization")
CRITIC_BACKENDS = ("lexicon", "openai", "transformers")
# The templates are package data (setup.cfg: ``trl_stable = prompts/*.txt``), so a non-editable install finds them;
# the repository's top-level ``prompts/critic_*.txt`` are links to these files, for ``--prompt_file prompts/...``.
PROMPTS_DIR = Path(__file__).resolve().parents[1] / "prompts"
_PLACEHOLDER_RE = re.compile(r"\{\}|\{prompt\}|\{completion\}|\{score\}")


def relc_token_reward_values(
    task: str, positive_reward_value: float, negative_reward_value: float
) -> tuple[float, float, float]:
    """RELC's ``--positive_reward_value`` / ``--negative_reward_value`` of `task` as our three per-token values
    ``(positive_reward_value, negative_reward_value, outside_span_reward_value)``.

    RELC's scripts (Cao et al., EMNLP 2024) use the two flags differently per task:

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


def scale_intrinsic_rewards(row: Sequence[float], coef: float = 1.0, max_abs_sum: float | None = None) -> list[float]:
    """One sample's intrinsic token rewards times `coef`, then scaled down so that their absolute sum is at most
    `max_abs_sum` (None: no bound).

    The bound keeps signs and proportions: a row whose ``sum_t |coef * r_t|`` exceeds `max_abs_sum` is multiplied by
    ``max_abs_sum / sum_t |coef * r_t|``, so its total lies in ``[-max_abs_sum, max_abs_sum]`` however many tokens the
    critic marked. ``coef=1, max_abs_sum=None`` (RELC) returns the row unchanged.

    Example:
        >>> scale_intrinsic_rewards([0.5, 0.5, -0.5, 0.5], coef=1.0, max_abs_sum=1.0)
        [0.25, 0.25, -0.25, 0.25]
    """
    scaled = [coef * float(v) for v in row]
    if max_abs_sum is not None:
        total = sum(abs(v) for v in scaled)
        if total > max_abs_sum:
            factor = max_abs_sum / total
            scaled = [v * factor for v in scaled]
    return scaled


def default_prompt_file(task: str) -> str:
    """Path of the bundled few-shot template of `task` (``trl_stable/prompts/critic_<task>.txt``, package data)."""
    return str(PROMPTS_DIR / f"critic_{task}.txt")


def load_critic_template(path: str | os.PathLike) -> str:
    """Read a critic template and check that it has a ``{}`` (or ``{completion}``) placeholder for the text."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"prompt_file {path!r} does not exist; pass the path of a critic template with a '{{}}'.")
    with open(path, encoding="utf-8") as f:
        template = f.read()
    if "{}" not in template and "{completion}" not in template:
        raise ValueError(f"prompt_file {path!r} has no '{{}}' placeholder for the text to critique; add one.")
    return template


def fill_critic_template(template: str, text: str, prompt: str = "", completion: str = "", score: Any = None) -> str:
    """Fill the placeholders ``{}`` (the text), ``{prompt}``, ``{completion}`` and ``{score}`` of `template`.

    Literal replacement, not `str.format`: few-shot examples may contain braces, and a completion containing "{}"
    must not be substituted twice.
    """
    score_text = "n/a" if score is None else f"{float(score):.4g}"
    pieces = {"{prompt}": prompt, "{completion}": completion, "{score}": score_text, "{}": text}
    return _PLACEHOLDER_RE.sub(lambda m: pieces[m.group(0)], template)


# Every numeric field of CriticRewardConfig and what is valid. The backend-specific fields are not tied to
# critic_backend: scripts choose the backend late (a critic_base_url means 'openai'), so they are checked alone.
CRITIC_BOUNDS: dict[str, Bound] = {
    "positive_reward_value": Bound(),
    "negative_reward_value": Bound(),
    "outside_span_reward_value": Bound(),
    "fuzzy_min_similarity": Bound(low=0.0, high=1.0, low_open=True),
    "critic_concurrency": Bound(low=1, integer=True, optional=True, fix="None sizes it to the batch."),
    "critic_max_concurrency": Bound(low=1, integer=True),
    "critic_retry_after_max": Bound(low=0.0, fix="In seconds."),
    "critic_timeout": Bound(low=0.0, low_open=True, fix="In seconds."),
    "critic_max_retries": Bound(low=0, integer=True),
    "critic_rate_limit": Bound(low=0.0, low_open=True, optional=True, fix="None: unlimited."),
    "critic_max_tokens": Bound(low=1, integer=True),
    "critic_temperature": Bound(low=0.0),
    "critic_batch_size": Bound(low=1, integer=True),
    "max_consecutive_failing_steps": Bound(low=1, integer=True),
}


@dataclass
class CriticRewardConfig:
    """Configuration of the dense intrinsic reward from an LLM critic (RELC's flag names).

    A token's reward is ``positive_reward_value`` inside a positive span, ``negative_reward_value`` inside a negative
    (toxic, flawed) span, and ``outside_span_reward_value`` inside no span. RELC's flags of the same names mean
    something else for toxicity and summarization; `from_relc` maps them.

    Example:
        >>> cfg = CriticRewardConfig.from_relc(task="toxicity", positive_reward_value=0.1, negative_reward_value=-0.5)
        >>> (cfg.positive_reward_value, cfg.negative_reward_value, cfg.outside_span_reward_value)
        (0.0, -0.5, 0.1)
    """

    use_intrinsic_reward: bool = field(
        default=False, metadata={"help": "Add the critic's per-token intrinsic rewards to the environment reward."}
    )
    use_instric_reward: bool = field(
        default=False,
        metadata={"help": "Alias of `use_intrinsic_reward` (RELC's spelling in its sentiment/summarization scripts)."},
    )
    critic_task: str = field(
        default="sentiment",
        metadata={"help": "Answer format and default prompt/lexicon: 'sentiment', 'toxicity' or 'summarization'."},
    )
    positive_reward_value: float = field(
        default=0.5,
        metadata={
            "help": "Reward of a token inside a positive span. Not RELC's toxicity flag of this name (that is the "
            "reward of a non-toxic token: outside_span_reward_value; see CriticRewardConfig.from_relc)."
        },
    )
    negative_reward_value: float = field(
        default=-0.5, metadata={"help": "Reward of a token inside a negative (toxic, flawed) span."}
    )
    outside_span_reward_value: float = field(
        default=0.0,
        metadata={
            "help": "Reward of a token inside no span, in completions whose critique parsed (RELC toxicity: its "
            "positive_reward_value, 0.1). Failed or unparseable critiques give no reward at all."
        },
    )
    fuzzy_span_matching: bool = field(
        default=False,
        metadata={
            "help": "Match spans the critic reworded ('is' for 'was') by similarity when they are not found as "
            "written; needs rapidfuzz (pip install 'trl_stable[fuzzy]')."
        },
    )
    fuzzy_min_similarity: float = field(
        default=0.85,
        metadata={"help": "Similarity floor in (0, 1] of a fuzzy match (rapidfuzz partial_ratio / 100)."},
    )
    intrinsic_reward_threshold: float = field(
        default=10.0,
        metadata={
            "help": "Only completions whose environment reward is <= this are critiqued (RELC: sentiment 10, "
            "toxicity 1.0, summarization 100). Use inf to critique every completion."
        },
    )
    intrinsic_reward_coef: float = field(
        default=1.0,
        metadata={
            "help": "Factor on every token's intrinsic reward, >= 0 (RELC: 1). With RELC's +-0.5 per token, a "
            "20-token completion can carry an intrinsic sum of +-10 against an environment reward in [-1, 1]."
        },
    )
    intrinsic_reward_max_sum: float | None = field(
        default=None,
        metadata={
            "help": "Bound, > 0, on a sample's total absolute intrinsic reward (after intrinsic_reward_coef): a row "
            "above it is scaled down to it, signs and proportions kept, so the critic's part stays commensurate "
            "with the environment reward (e.g. 1.0 for a reward in [-1, 1]). None: no bound (RELC)."
        },
    )
    critic_lexicon: str = field(
        default="vader",
        metadata={
            "help": "Word list of the offline lexicon critic for sentiment: 'vader' (VADER's; the same lexicon as "
            "the embedded environment reward, so the critic is that reward, densified) or 'afinn' (AFINN-165, an "
            "independently built list; pip install afinn). Only critic_backend='lexicon', critic_task='sentiment'."
        },
    )
    prompt_file: str | None = field(
        default=None,
        metadata={
            "help": "Few-shot critic template with a '{}' placeholder; default the bundled "
            "trl_stable/prompts/critic_<task>.txt (also reachable as prompts/critic_<task>.txt in a checkout)."
        },
    )
    critic_backend: str = field(
        default="lexicon",
        metadata={"help": "'openai' (any OpenAI-compatible server), 'transformers' (local model) or 'lexicon'."},
    )
    critic_model: str | None = field(
        default=None,
        metadata={
            "help": "Critic model: the served model name (openai; default gpt-4o-mini) or a local path "
            "(transformers; or pass the model object to CriticIntrinsicReward for self-critique)."
        },
    )
    critic_base_url: str | None = field(
        default=None,
        metadata={"help": "Base URL of an OpenAI-compatible server, e.g. http://localhost:8000/v1 (vLLM)."},
    )
    critic_api_key_env: str = field(
        default="OPENAI_API_KEY",
        metadata={
            "help": "Name of the environment variable holding the critic API key (the key itself is never stored; "
            "a value that is no variable name or looks like a key is refused, without repeating it)."
        },
    )
    critic_concurrency: int | None = field(
        default=None,
        metadata={
            "help": "Critic requests in flight at once (openai); None: every request of a batch at once (a batch "
            "costs about one server latency), up to critic_max_concurrency."
        },
    )
    critic_max_concurrency: int = field(
        default=256,
        metadata={"help": "Most critic requests in flight at once when critic_concurrency is None (openai)."},
    )
    critic_retry_after_max: float = field(
        default=60.0,
        metadata={
            "help": "Longest wait, in seconds, a critic server's Retry-After / retry-after-ms may ask for before a "
            "retry (openai); longer requests are cut to it, and a wait above the backoff cap (8 s) is logged."
        },
    )
    critic_cache_dir: str | None = field(
        default=None, metadata={"help": "Directory of the on-disk critic answer cache (openai); None: memory only."}
    )
    critic_timeout: float = field(default=30.0, metadata={"help": "Seconds per critic request (openai)."})
    critic_transport: str = field(
        default="http",
        metadata={
            "help": "HTTP client of the openai backend: 'http' (a lean standard-library client; about a tenth of "
            "the SDK's CPU per request, which is what a batch of concurrent requests waits on) or 'openai' (the "
            "OpenAI SDK)."
        },
    )
    critic_max_retries: int = field(
        default=4, metadata={"help": "Retries of a critic request on 429/5xx/timeout/connection errors (openai)."}
    )
    critic_rate_limit: float | None = field(
        default=None, metadata={"help": "Most critic requests started per second (openai); None: unlimited."}
    )
    critic_max_tokens: int = field(default=128, metadata={"help": "Longest critic answer, in tokens."})
    critic_temperature: float = field(default=0.0, metadata={"help": "Critic sampling temperature (openai)."})
    critic_batch_size: int = field(default=8, metadata={"help": "Prompts per generate call (transformers)."})
    critic_include_prompt: bool = field(
        default=True,
        metadata={
            "help": "Show the critic the prompt followed by the completion (RELC's query+response); spans are "
            "rewarded only where they occur in the completion."
        },
    )
    max_consecutive_failing_steps: int = field(
        default=5,
        metadata={
            "help": "Stop with an error after this many consecutive steps in which every critic request failed; "
            "single failures only zero the intrinsic reward of their samples."
        },
    )

    def __post_init__(self) -> None:
        if self.use_instric_reward:
            self.use_intrinsic_reward = True
        if self.critic_task not in CRITIC_TASKS:
            raise ValueError(f"critic_task must be one of {CRITIC_TASKS}, got {self.critic_task!r}.")
        if self.critic_backend not in CRITIC_BACKENDS:
            raise ValueError(f"critic_backend must be one of {CRITIC_BACKENDS}, got {self.critic_backend!r}.")
        if self.critic_backend == "lexicon" and self.critic_task == "summarization":
            raise ValueError(
                "critic_backend='lexicon' has no summarization lexicon; use critic_backend='openai' or "
                "'transformers' for critic_task='summarization'."
            )
        check_bounds(self, CRITIC_BOUNDS)
        # +inf critiques every completion (and -inf none); NaN compares false with every reward.
        check_all_finite(self, allow_infinite=("intrinsic_reward_threshold",))
        check_dependents(
            self, (Dependent(("fuzzy_min_similarity",), self.fuzzy_span_matching, "fuzzy_span_matching=True"),)
        )
        if self.use_intrinsic_reward and self.fuzzy_span_matching:
            import_rapidfuzz()  # fail at configuration time, not at the first critiqued step
        if self.critic_task == "toxicity" and self.positive_reward_value != 0 and self.outside_span_reward_value == 0:
            logger.warning(
                "critic_task='toxicity' names only toxic spans, so positive_reward_value=%s rewards no token. RELC's "
                "positive_reward_value is the reward of a non-toxic token: set outside_span_reward_value, or build "
                "the config with CriticRewardConfig.from_relc(task='toxicity', ...).",
                self.positive_reward_value,
            )
        if self.critic_transport not in ("http", "openai"):
            raise ValueError(
                f"critic_transport must be 'http' (standard-library client) or 'openai' (the SDK), got "
                f"{self.critic_transport!r}."
            )
        # the key itself typed here would be echoed by "set the environment variable ..." errors and saved
        check_env_var_name("critic_api_key_env", self.critic_api_key_env)
        if self.prompt_file is not None and not os.path.isfile(self.prompt_file):
            raise ValueError(f"prompt_file {self.prompt_file!r} does not exist; pass an existing critic template.")
        self._check_scale_and_lexicon()

    def _check_scale_and_lexicon(self) -> None:
        """Validation of `intrinsic_reward_coef`, `intrinsic_reward_max_sum` and `critic_lexicon`."""
        if not (math.isfinite(self.intrinsic_reward_coef) and self.intrinsic_reward_coef >= 0):
            raise ValueError(
                f"intrinsic_reward_coef must be a finite number >= 0 (1: RELC), got {self.intrinsic_reward_coef}; "
                "to reverse the critic's judgement swap positive_reward_value and negative_reward_value instead."
            )
        bound = self.intrinsic_reward_max_sum
        if bound is not None and not (math.isfinite(bound) and bound > 0):
            raise ValueError(
                f"intrinsic_reward_max_sum must be a finite number > 0, or None for no bound (RELC), got {bound}."
            )
        if self.critic_lexicon not in SENTIMENT_LEXICONS:
            raise ValueError(f"critic_lexicon must be one of {SENTIMENT_LEXICONS}, got {self.critic_lexicon!r}.")
        if self.critic_lexicon != "vader" and self.critic_task != "sentiment":
            raise ValueError(
                f"critic_lexicon={self.critic_lexicon!r} is a sentiment lexicon; critic_task={self.critic_task!r} "
                "has one lexicon only (leave critic_lexicon='vader')."
            )

    @classmethod
    def from_relc(
        cls, task: str, positive_reward_value: float, negative_reward_value: float, **kwargs: Any
    ) -> CriticRewardConfig:
        """A config whose token rewards are RELC's for `task` given RELC's two flag values
        (`relc_token_reward_values`); `kwargs` are the other fields.

        Example:
            >>> CriticRewardConfig.from_relc("sentiment", 0.5, -0.5).outside_span_reward_value
            0.0
        """
        pos, neg, outside = relc_token_reward_values(task, positive_reward_value, negative_reward_value)
        return cls(
            critic_task=task,
            positive_reward_value=pos,
            negative_reward_value=neg,
            outside_span_reward_value=outside,
            **kwargs,
        )

    @property
    def fuzzy_threshold(self) -> float | None:
        """The similarity floor for span alignment, None when fuzzy matching is off."""
        return self.fuzzy_min_similarity if self.fuzzy_span_matching else None

    @property
    def resolved_prompt_file(self) -> str:
        return self.prompt_file or default_prompt_file(self.critic_task)


def build_critic_backend(config: CriticRewardConfig, model: Any = None, tokenizer: Any = None) -> CriticBackend:
    """The backend `config` asks for; `model`/`tokenizer` are the local critic (e.g. the policy) for 'transformers'."""
    if config.critic_backend == "lexicon":
        return LexiconCritic(task=config.critic_task, lexicon=config.critic_lexicon)
    if config.critic_backend == "openai":
        return OpenAICritic(
            model=config.critic_model or "gpt-4o-mini",
            base_url=config.critic_base_url,
            api_key_env=config.critic_api_key_env,
            temperature=config.critic_temperature,
            max_tokens=config.critic_max_tokens,
            concurrency=config.critic_concurrency,
            max_concurrency=config.critic_max_concurrency,
            retry_after_max=config.critic_retry_after_max,
            timeout=config.critic_timeout,
            max_retries=config.critic_max_retries,
            rate_limit=config.critic_rate_limit,
            cache_dir=config.critic_cache_dir,
            transport=config.critic_transport,
        )
    critic = model if model is not None else config.critic_model
    if critic is None:
        raise ValueError(
            "critic_backend='transformers' needs critic_model (a local model path) or a model object "
            "(e.g. the policy, for self-critique)."
        )
    return TransformersCritic(
        critic, tokenizer=tokenizer, batch_size=config.critic_batch_size, max_new_tokens=config.critic_max_tokens
    )


def _as_text(x: Any) -> str:
    """A prompt or completion as plain text; conversational messages are joined by their contents."""
    if isinstance(x, str):
        return x
    if isinstance(x, dict):
        return str(x.get("content", ""))
    if isinstance(x, Sequence):
        return "\n".join(_as_text(m) for m in x)
    return "" if x is None else str(x)


def _is_nan(x: Any) -> bool:
    return x is None or math.isnan(float(x))


class CriticFailureError(RuntimeError):
    """Every critic request failed (or gave an unparseable answer) for `max_consecutive_failing_steps` consecutive
    steps, or the critic server rejected the API key (at the first step)."""


_STEP_COUNTERS = (
    "steps",
    "samples",
    "critiqued",
    "nan_env_rewards",
    "answers",
    "failed_answers",
    "unparseable",
    "spans_positive",
    "spans_negative",
    "spans_unlocated",
    "spans_matched",
    "spans_partial",
    "spans_query_only",
    "spans_unmatched",
    "spans_fuzzy",
    "answers_with_ignored_text",
    "tokens_total",
    "tokens_rewarded",
    "samples_bounded",  # rows that intrinsic_reward_max_sum scaled down
)


_STATUS_COUNTER = {
    MATCHED: "spans_matched", PARTIAL: "spans_partial", QUERY_ONLY: "spans_query_only", UNMATCHED: "spans_unmatched",
}  # fmt: skip

# Every backend counter is logged per step (``critic/step_<name>``), so a failing critic shows in the training logs.
_LOGGED_BACKEND_COUNTERS = COUNTER_NAMES
# The request failures by kind, for the error message of a failing run.
_FAILURE_KINDS = (
    "timeouts", "rate_limited", "server_errors", "connection_errors", "bad_responses", "client_errors",
    "deadline_exceeded",
)  # fmt: skip


class CriticIntrinsicReward:
    """Dense reward function: per-token intrinsic rewards from a critic's spans.

    Call signature (TRL's, plus `env_rewards`):
    ``reward(prompts, completions, completion_ids, env_rewards=None, **kwargs) -> list[list[float] | None]``.
    Completions are critiqued when ``env_rewards[i] <= intrinsic_reward_threshold`` (all of them when
    `env_rewards` is None); the others get None (zero). The completion text is ``decode(completion_ids[i])`` and
    token offsets come from `token_char_offsets`, so rewards align with the trained tokens exactly.

    Failures (timeout, HTTP errors, garbage, None) give their samples zero reward and are counted; only
    `max_consecutive_failing_steps` consecutive steps in which every request failed raise `CriticFailureError`.

    Args:
        config: A `CriticRewardConfig`.
        tokenizer: The policy's tokenizer (to decode completions and get token offsets).
        backend: A ready `CriticBackend`; default built from `config`.
        critic_model: For ``critic_backend='transformers'``: a model object (e.g. the policy) to critique with.
        critic_tokenizer: Its tokenizer (default `tokenizer`).
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
        # The header the template ends with: RELC-style prompts make the critic continue it (see
        # `continuation_header`); the filled prompt ends as the template does unless the text itself is last.
        self.answer_header = continuation_header(self.template)
        tail = self.template.rstrip().splitlines()[-1].strip() if self.template.strip() else ""
        if self.answer_header is None and tail.endswith(":") and "{" not in tail:
            logger.warning(
                "The critic template ends with %r, which is no answer header the parser reads; answers must then "
                "carry their own headers.",
                tail,
            )
        if backend is None and config.use_intrinsic_reward:
            backend = build_critic_backend(config, critic_model, critic_tokenizer or tokenizer)
        self.backend = backend
        if backend is not None and hasattr(backend, "set_answer_validator"):
            # Cache only answers that parse (with this template's continuation header): garbage is asked again.
            header = self.answer_header
            backend.set_answer_validator(
                lambda answer: parse_critic_answer(answer, continues=header).ok, f"critic_parsing/{PARSER_VERSION}"
            )
        self._counts = dict.fromkeys(_STEP_COUNTERS, 0)
        self._last: dict[str, float] = {}
        self.consecutive_failing_steps = 0

    def __repr__(self) -> str:
        return f"CriticIntrinsicReward(task={self.config.critic_task!r}, backend={self.backend!r})"

    def critic_prompt(self, prompt_text: str, completion_text: str, env_reward: float | None) -> str:
        """The critic prompt of one sample (newlines flattened as RELC did, so one-line answer formats hold)."""
        text = (prompt_text + completion_text) if self.config.critic_include_prompt else completion_text
        flat = " ".join(text.split())
        return fill_critic_template(
            self.template,
            flat,
            prompt=" ".join(prompt_text.split()),
            completion=" ".join(completion_text.split()),
            score=env_reward,
        )

    def _selected(self, n: int, env_rewards: Sequence[float] | None) -> list[int]:
        if env_rewards is None:
            return list(range(n))
        if len(env_rewards) != n:
            raise ValueError(f"env_rewards has {len(env_rewards)} entries for {n} completions.")
        # A NaN (or missing) environment reward is never <= the threshold: such a sample is not critiqued, only
        # counted (critic/nan_env_rewards); the trainer's own NaN handling decides what happens to it.
        thr = self.config.intrinsic_reward_threshold
        return [i for i, r in enumerate(env_rewards) if not _is_nan(r) and float(r) <= thr]

    def _tokenizer(self, kwargs: dict[str, Any]) -> Any:
        tokenizer = self.tokenizer or kwargs.get("processing_class") or kwargs.get("tokenizer")
        if tokenizer is None:
            raise ValueError("CriticIntrinsicReward needs the policy tokenizer: CriticIntrinsicReward(config, tok).")
        return tokenizer

    def _prepare(self, tokenizer, prompts, completion_ids, env_rewards):
        """Selected indices, their ids, decoded texts, prompt texts and critic prompts."""
        selected = self._selected(len(completion_ids), env_rewards)
        ids = {i: [int(t) for t in completion_ids[i]] for i in selected}
        texts = {i: decode_response(tokenizer, ids[i]) for i in selected}
        prompt_texts = {i: _as_text(prompts[i]) if prompts is not None else "" for i in selected}
        critic_prompts = [
            self.critic_prompt(prompt_texts[i], texts[i], None if env_rewards is None else float(env_rewards[i]))
            for i in selected
        ]
        return selected, ids, texts, prompt_texts, critic_prompts

    def prefetch(
        self,
        prompts: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        env_rewards: Sequence[float] | None = None,
        **kwargs: Any,
    ) -> CriticPrefetch | None:
        """Start the critic requests now and return at once (the dense-reward prefetch protocol of
        `trl_stable.rewards.dense`); the trainer passes the result back as ``prefetched=`` to the later call.

        That call collects these requests instead of asking again, so each answer is requested, counted and paid
        once. It must see the same completions and `env_rewards` (templates showing ``{score}`` need the final
        ones); if it does not, it warns and asks afresh. The token offsets are computed here too, while the critic
        answers. A no-op (None) for backends that answer synchronously (lexicon, transformers): there is nothing to
        overlap, and the call does the work.
        """
        if not self.config.use_intrinsic_reward or self.backend is None or not self.backend.concurrent:
            return None
        return self._start(self._tokenizer(kwargs), prompts, completion_ids, env_rewards)

    def _start(self, tokenizer, prompts, completion_ids, env_rewards) -> CriticPrefetch:
        """Prepare the batch, submit its critic prompts, and align the token offsets while the critic answers."""
        started = time.monotonic()
        before = self.backend.counters.snapshot()
        selected, ids, texts, prompt_texts, critic_prompts = self._prepare(
            tokenizer, prompts, completion_ids, env_rewards
        )
        job = self.backend.submit(critic_prompts, texts=[texts[i] for i in selected]) if selected else None
        aligned = {i: token_char_offsets(tokenizer, ids[i]) for i in selected}
        return CriticPrefetch(
            completion_ids=[[int(t) for t in c] for c in completion_ids],
            env_rewards=None if env_rewards is None else [float(r) for r in env_rewards],
            selected=selected,
            prompt_texts=prompt_texts,
            aligned=aligned,
            job=job,
            started=started,
            counters_before=before,
        )

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
            return [None] * n
        waited_from = time.monotonic()
        if prefetched is not None and not prefetched.matches(completion_ids, env_rewards):
            logger.warning(
                "The critic call got other completions or env_rewards than its prefetch; asking the critic again "
                "(the prefetched answers are in the cache). Pass the prefetch the call's own arguments."
            )
            prefetched = None
        batch = prefetched or self._start(self._tokenizer(kwargs), prompts, completion_ids, env_rewards)

        step = dict.fromkeys(_STEP_COUNTERS, 0)
        step["steps"], step["samples"], step["critiqued"] = 1, n, len(batch.selected)
        step["nan_env_rewards"] = sum(_is_nan(r) for r in env_rewards) if env_rewards is not None else 0
        step["tokens_total"] = sum(len(c) for c in completion_ids)
        rows: list[list[float] | None] = [None] * n
        # Each answer is parsed and aligned as it arrives, while the later ones are still in flight.
        for k, answer in batch.job.as_completed() if batch.job is not None else ():
            i = batch.selected[k]
            context = batch.prompt_texts[i] if self.config.critic_include_prompt else ""
            rows[i] = self._row(answer, *batch.aligned[i], step, context=context)
        t0, before = batch.started, batch.counters_before
        if step["unparseable"]:
            logger.warning(
                "%d of %d critic answers had no recognisable span format (their samples get no intrinsic reward; "
                "critic/unparseable_fraction).",
                step["unparseable"],
                step["answers"],
            )
        if step["answers_with_ignored_text"]:
            logger.warning(
                "%d critic answers had spans before their first header, which were ignored: the prompt seems to end "
                "with a header the parser was not told about (critic/answers_with_ignored_text).",
                step["answers_with_ignored_text"],
            )
        now = time.monotonic()
        self._record(step, now - t0, now - waited_from, before, kwargs.get("log_metric"))
        fatal = self.backend.fatal_error() if hasattr(self.backend, "fatal_error") else None
        if fatal is not None:  # a rejected key fails every later step too: stop now, not after N paid steps
            raise CriticFailureError(fatal)
        if batch.selected:  # a step that critiques nothing says nothing about the critic
            # An unparseable answer is as useless as no answer: a critic that only answers garbage must stop the run.
            self._track_failing_steps(step["failed_answers"] + step["unparseable"] == len(batch.selected), step)
        return rows

    def _row(
        self, answer: str | None, text: str, offsets: list[tuple[int, int]], step: dict, context: str = ""
    ) -> list[float] | None:
        """The per-token rewards from one critic answer (None: failed or unparseable, counted in `step`).

        Spans are located in `context` (the prompt the critic read before the completion) + `text`; only the
        completion's tokens are rewarded.
        """
        if answer is None:
            step["failed_answers"] += 1
            return None
        step["answers"] += 1
        parsed = parse_critic_answer(answer, continues=self.answer_header)
        if not parsed.ok:
            step["unparseable"] += 1
            logger.debug("Unparseable critic answer (%s)", parsed.reason)
            return None
        step["answers_with_ignored_text"] += bool(parsed.ignored_text)
        step["spans_positive"] += len(parsed.positive)
        step["spans_negative"] += len(parsed.negative)
        fuzzy = self.config.fuzzy_threshold
        positive = align_spans(text, parsed.positive, context, fuzzy)
        negative = align_spans(text, parsed.negative, context, fuzzy)
        for a in [*positive, *negative]:
            step[_STATUS_COUNTER[a.status]] += 1
            step["spans_unlocated"] += a.status in (QUERY_ONLY, UNMATCHED)
            step["spans_fuzzy"] += a.fuzzy
        row = rewards_from_alignments(
            offsets,
            positive,
            negative,
            positive_value=self.config.positive_reward_value,
            negative_value=self.config.negative_reward_value,
            outside_value=self.config.outside_span_reward_value,
        )
        bound = self.config.intrinsic_reward_max_sum
        scaled = scale_intrinsic_rewards(row, self.config.intrinsic_reward_coef, bound)
        coef = self.config.intrinsic_reward_coef
        step["samples_bounded"] += bound is not None and sum(abs(coef * v) for v in row) > bound
        step["tokens_rewarded"] += sum(v != 0.0 for v in scaled)
        return scaled

    def _track_failing_steps(self, all_failed: bool, step: dict | None = None) -> None:
        """Count consecutive steps in which no critique was usable (every request failed or its answer did not
        parse); raise `CriticFailureError` at the limit, saying what failed in the last step."""
        if not all_failed:
            self.consecutive_failing_steps = 0
            return
        self.consecutive_failing_steps += 1
        what = self._failure_summary(step)
        if self.consecutive_failing_steps >= self.config.max_consecutive_failing_steps:
            hint = (
                "The server answers, but not in the span format of the prompt: check critic_model, prompt_file and "
                "critic_max_tokens (a cut-off answer does not parse)."
                if step is not None and step["unparseable"] and not step["failed_answers"]
                else "Check critic_base_url / critic_model and that the server is up."
            )
            raise CriticFailureError(
                f"The {self.backend.name} critic gave no usable critique for {self.consecutive_failing_steps} "
                f"consecutive steps (last step: {what}). {hint} Or raise max_consecutive_failing_steps."
            )
        logger.warning(
            "No usable critique this step (%s; %d/%d consecutive); intrinsic rewards are zero.",
            what,
            self.consecutive_failing_steps,
            self.config.max_consecutive_failing_steps,
        )

    def _failure_summary(self, step: dict | None) -> str:
        """The last step's failures by kind, e.g. "2 failed requests (timeouts 3, server_errors 1), 1 unparseable"."""
        if step is None:
            return "every request failed"
        kinds = ", ".join(
            f"{k} {int(self._last.get(f'critic/step_{k}', 0))}"
            for k in _FAILURE_KINDS
            if self._last.get(f"critic/step_{k}", 0)
        )
        parts = []
        if step["failed_answers"]:
            parts.append(f"{step['failed_answers']} failed requests" + (f" ({kinds})" if kinds else ""))
        if step["unparseable"]:
            parts.append(f"{step['unparseable']} unparseable answers")
        return ", ".join(parts) or "no usable answer"

    def _record(self, step: dict, seconds: float, wait: float, before: dict[str, int], log_metric: Any) -> None:
        """Add `step` to the cumulative counts, keep the step's ratios, and hand them to TRL's `log_metric` hook."""
        for k, v in step.items():
            self._counts[k] += v
        # the fractions from one table, which the trainers also use to recompute them from the counts of every process
        self._last = {
            **critic_step_ratios(step),
            CRITIC_STAGE_SECONDS: seconds,  # from the requests' start (the prefetch, if any) to the rewards
            CRITIC_WAIT_SECONDS: wait,  # what the trainer waited in the call: the critic's cost after the overlap
        }
        after = self.backend.counters.snapshot()
        for name in _LOGGED_BACKEND_COUNTERS:
            self._last[f"{CRITIC_STEP_PREFIX}{name}"] = after.get(name, 0) - before.get(name, 0)
        for name in _STEP_COUNTERS:  # this step's own counts (answers, failed_answers, unparseable, spans, ...)
            if name != "steps":
                self._last[f"{CRITIC_STEP_PREFIX}{name}"] = step[name]
        if callable(log_metric):  # TRL's GRPOTrainer hands reward functions this hook; values average per log
            for name, value in self._last.items():
                log_metric(name, float(value))

    def metrics(self) -> dict[str, float]:
        """Counters and ratios for logging, all named ``critic/...``.

        Cumulative: the backend's requests, attempts, retries, failures, cache_hits, timeouts, rate_limited,
        server_errors, connection_errors, bad_responses, prompt/completion tokens; and steps, samples, critiqued,
        answers, failed_answers, unparseable, answers_with_ignored_text, spans_positive/negative/unlocated,
        spans_matched/partial/query_only/unmatched/fuzzy, tokens_total/rewarded, rewarded_token_fraction. Last step
        (as ``critic/last_...``): critiqued_fraction, failed_fraction, unparseable_fraction, rewarded_token_fraction,
        spans_per_critique, spans_matched_frac/partial_frac/query_only_frac/unmatched_frac/fuzzy_frac,
        stage_seconds (from the requests' start, the prefetch if any, to the rewards), wait_seconds (what the call
        itself waited: the critic's cost to the step after the overlap); and consecutive_failing_steps.
        """
        out = self.backend.metrics() if self.backend is not None else {}
        out.update({f"critic/{k}": float(v) for k, v in self._counts.items()})
        out["critic/rewarded_token_fraction"] = self._counts["tokens_rewarded"] / max(self._counts["tokens_total"], 1)
        out.update({k.replace("critic/", "critic/last_"): float(v) for k, v in self._last.items()})
        out["critic/consecutive_failing_steps"] = float(self.consecutive_failing_steps)
        return out

    def checkpoint_state(self) -> dict[str, Any]:
        """The cumulative counts (this function's and its backend's), the last step's metrics and the failing-step
        count, for a checkpoint: trl_stable's trainers save it and restore it on resume, so the counters go on."""
        return {
            "counts": dict(self._counts),
            "last": dict(self._last),
            "consecutive_failing_steps": self.consecutive_failing_steps,
            "backend_counters": self.backend.counters.snapshot() if self.backend is not None else None,
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Continue from `checkpoint_state()`'s output."""
        self._counts = {**dict.fromkeys(_STEP_COUNTERS, 0), **state["counts"]}
        self._last = dict(state["last"])
        self.consecutive_failing_steps = int(state["consecutive_failing_steps"])
        if self.backend is not None and state["backend_counters"] is not None:
            self.backend.counters.restore(state["backend_counters"])

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()


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

    def matches(self, completion_ids: Sequence[Sequence[int]], env_rewards: Sequence[float] | None) -> bool:
        if [[int(t) for t in c] for c in completion_ids] != self.completion_ids:
            return False
        if env_rewards is None or self.env_rewards is None:
            return env_rewards is None and self.env_rewards is None
        return len(env_rewards) == len(self.env_rewards) and all(
            (_is_nan(a) and _is_nan(b)) or float(a) == b for a, b in zip(env_rewards, self.env_rewards)
        )


def make_intrinsic_reward(config: CriticRewardConfig, tokenizer: Any, **kwargs: Any) -> CriticIntrinsicReward:
    """Shorthand for ``CriticIntrinsicReward(config, tokenizer, **kwargs)``."""
    return CriticIntrinsicReward(config, tokenizer, **kwargs)
