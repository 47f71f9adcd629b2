"""The critic's two configurations: which critic answers and how it is reached (`CriticBackendConfig`), and what its
answers become (`CriticRewardConfig`, which includes the first, so every field is one flat flag of a script).

Every numeric field is checked against its range when the config is built. Whether a backend field applies
(`CriticBackendConfig.backend_dependents`: `critic_base_url` only with the OpenAI-compatible backend, `critic_model`
only with an LLM, ...) is checked when the backend is built (`trl_stable.rewards.critic.factory`), by the shared
rule of `trl_stable.settings.checks`: scripts choose the backend late (a paper-mode default, a backend object).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from trl_stable.rewards.critic.alignment import import_rapidfuzz
from trl_stable.rewards.critic.lexicon import SENTIMENT_LEXICONS
from trl_stable.rewards.critic.parsing import continuation_header, parse_critic_answer
from trl_stable.rewards.critic.templates import default_prompt_file
from trl_stable.rewards.critic.transport import TRANSPORTS
from trl_stable.settings.checks import Bound, Dependent, check_all_finite, check_bounds, check_dependents
from trl_stable.settings.secrets import SecretsNotPickled

logger = logging.getLogger(__name__)

CRITIC_TASKS = ("sentiment", "toxicity", "summarization")
CRITIC_BACKENDS = ("lexicon", "openai", "transformers")

BACKEND_BOUNDS: dict[str, Bound] = {
    "critic_concurrency": Bound(low=1, integer=True, optional=True, fix="None sizes it to the batch."),
    "critic_max_concurrency": Bound(low=1, integer=True),
    "critic_retry_after_max": Bound(low=0.0, fix="In seconds."),
    "critic_timeout": Bound(low=0.0, low_open=True, fix="In seconds."),
    "critic_max_retries": Bound(low=0, integer=True),
    "critic_rate_limit": Bound(low=0.0, low_open=True, optional=True, fix="None: unlimited."),
    "critic_max_tokens": Bound(low=1, integer=True),
    "critic_temperature": Bound(low=0.0),
    "critic_batch_size": Bound(low=1, integer=True),
}
REWARD_BOUNDS: dict[str, Bound] = {
    "positive_reward_value": Bound(),
    "negative_reward_value": Bound(),
    "outside_span_reward_value": Bound(),
    "fuzzy_min_similarity": Bound(low=0.0, high=1.0, low_open=True),
    "intrinsic_reward_coef": Bound(
        low=0.0, fix="To reverse the critic's judgement swap positive_reward_value and negative_reward_value."
    ),
    "intrinsic_reward_max_sum": Bound(low=0.0, low_open=True, optional=True, fix="None: no bound."),
    "max_consecutive_failing_steps": Bound(low=1, integer=True),
}
# Every numeric field of CriticRewardConfig and what is valid.
CRITIC_BOUNDS: dict[str, Bound] = {**REWARD_BOUNDS, **BACKEND_BOUNDS}
# What only the OpenAI-compatible backend reads.
_OPENAI_FIELDS = (
    "critic_base_url", "critic_api_key_env", "critic_concurrency", "critic_max_concurrency", "critic_retry_after_max",
    "critic_cache_dir", "critic_timeout", "critic_transport", "critic_max_retries", "critic_rate_limit",
    "critic_temperature",
)  # fmt: skip


@dataclass
class CriticBackendConfig(SecretsNotPickled):
    """Which critic answers and how it is reached: the backend, its model, and the OpenAI-compatible transport's
    settings (URL, key variable, concurrency, timeouts, retries, rate limit, cache).

    """

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
    critic_lexicon: str = field(
        default="vader",
        metadata={
            "help": "Word list of the offline lexicon critic for sentiment: 'vader' (VADER's; the same lexicon as "
            "the embedded environment reward, so the critic is that reward, densified) or 'afinn' (AFINN-165, an "
            "independently built list; pip install afinn). Only critic_backend='lexicon', critic_task='sentiment'."
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
            "help": "HTTP client of the openai backend: 'http' (httpx, one keep-alive connection per worker "
            "thread; proxies and TLS from the environment) or 'openai' (the OpenAI SDK, about 0.6 ms more CPU per "
            "request, which is what a batch of concurrent requests waits on)."
        },
    )
    critic_max_retries: int = field(
        default=4, metadata={"help": "Retries of a critic request on 429/5xx/timeout/connection errors (openai)."}
    )
    critic_rate_limit: float | None = field(
        default=None, metadata={"help": "Most critic requests started per second (openai); None: unlimited."}
    )
    critic_max_tokens: int = field(
        default=128, metadata={"help": "Longest critic answer, in tokens (openai, transformers)."}
    )
    critic_temperature: float = field(default=0.0, metadata={"help": "Critic sampling temperature (openai)."})
    critic_batch_size: int = field(default=8, metadata={"help": "Prompts per generate call (transformers)."})

    def backend_dependents(self) -> tuple[Dependent, ...]:
        """The backend fields and the `critic_backend` that reads them (checked by `build_critic_backend`)."""
        backend = self.critic_backend
        return (
            Dependent(_OPENAI_FIELDS, backend == "openai", "critic_backend='openai'"),
            Dependent(("critic_model", "critic_max_tokens"), backend != "lexicon", "an LLM critic_backend"),
            Dependent(("critic_batch_size",), backend == "transformers", "critic_backend='transformers'"),
            Dependent(("critic_lexicon",), backend == "lexicon", "critic_backend='lexicon'"),
        )

    def __post_init__(self) -> None:
        if self.critic_backend not in CRITIC_BACKENDS:
            raise ValueError(f"critic_backend must be one of {CRITIC_BACKENDS}, got {self.critic_backend!r}.")
        if self.critic_transport not in TRANSPORTS:
            raise ValueError(
                f"critic_transport must be 'http' (our client) or 'openai' (the SDK), got {self.critic_transport!r}."
            )
        if self.critic_lexicon not in SENTIMENT_LEXICONS:
            raise ValueError(f"critic_lexicon must be one of {SENTIMENT_LEXICONS}, got {self.critic_lexicon!r}.")
        # every *_env field (critic_api_key_env): the key itself typed there would be echoed by errors and saved
        super().__post_init__()


@dataclass
class CriticRewardConfig(CriticBackendConfig):
    """Configuration of the dense intrinsic reward from an LLM critic: what the critic's answers become, plus the
    backend's fields (`CriticBackendConfig`).

    A token's reward is ``positive_reward_value`` inside a positive span, ``negative_reward_value`` inside a negative
    (toxic, flawed) span, and ``outside_span_reward_value`` inside no span. `continuation_header` and `parse_answer`
    are the answer format the reward reads (`trl_stable.compat.relc_critic.RelcCriticRewardConfig` adds RELC's).
    """

    continuation_header = staticmethod(continuation_header)
    parse_answer = staticmethod(parse_critic_answer)

    use_intrinsic_reward: bool = field(
        default=False, metadata={"help": "Add the critic's per-token intrinsic rewards to the environment reward."}
    )
    critic_task: str = field(
        default="sentiment",
        metadata={"help": "Answer format and default prompt/lexicon: 'sentiment', 'toxicity' or 'summarization'."},
    )
    positive_reward_value: float = field(
        default=0.5,
        metadata={
            "help": "Reward of a token inside a positive span (the reward of a token outside every toxic or flawed "
            "span is outside_span_reward_value)."
        },
    )
    negative_reward_value: float = field(
        default=-0.5, metadata={"help": "Reward of a token inside a negative (toxic, flawed) span."}
    )
    outside_span_reward_value: float = field(
        default=0.0,
        metadata={
            "help": "Reward of a token inside no span, in completions whose critique parsed (e.g. 0.1 for every "
            "non-toxic token). Failed or unparseable critiques give no reward at all."
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
    prompt_file: str | None = field(
        default=None,
        metadata={
            "help": "Few-shot critic template with a '{}' placeholder; default the bundled "
            "trl_stable/prompts/critic_<task>.txt (also reachable as prompts/critic_<task>.txt in a checkout)."
        },
    )
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
        super().__post_init__()
        if self.critic_task not in CRITIC_TASKS:
            raise ValueError(f"critic_task must be one of {CRITIC_TASKS}, got {self.critic_task!r}.")
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
                "critic_task='toxicity' names only toxic spans, so positive_reward_value=%s rewards no token; the "
                "reward of a non-toxic token is outside_span_reward_value (RELC's scripts call it "
                "--positive_reward_value: trl_stable.compat.relc_critic.RelcCriticRewardConfig.from_relc maps it).",
                self.positive_reward_value,
            )
        if self.prompt_file is not None and not os.path.isfile(self.prompt_file):
            raise ValueError(f"prompt_file {self.prompt_file!r} does not exist; pass an existing critic template.")
        if self.critic_lexicon != "vader" and self.critic_task != "sentiment":
            raise ValueError(
                f"critic_lexicon={self.critic_lexicon!r} is a sentiment lexicon; critic_task={self.critic_task!r} "
                "has one lexicon only (leave critic_lexicon='vader')."
            )

    @property
    def fuzzy_threshold(self) -> float | None:
        """The similarity floor for span alignment, None when fuzzy matching is off."""
        return self.fuzzy_min_similarity if self.fuzzy_span_matching else None

    @property
    def resolved_prompt_file(self) -> str:
        return self.prompt_file or default_prompt_file(self.critic_task)
