"""The critic's two configurations: which critic answers and how it is reached (`CriticBackendConfig`), and what its
answers become (`CriticRewardConfig`, which includes the first, so every field is one flat flag of a script).
Numeric fields are checked when the config is built; whether a backend field applies, when the backend is built.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from trl_stable.rewards.critic.alignment import import_rapidfuzz
from trl_stable.rewards.critic.lexicon import SENTIMENT_LEXICONS
from trl_stable.rewards.critic.parsing import continuation_header, parse_critic_answer
from trl_stable.rewards.critic.templates import default_prompt_file
from trl_stable.rewards.critic.transport import check_transport
from trl_stable.settings.checks import Bound, Dependent, check_all_finite, check_bounds, check_dependents, option
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
# Every numeric field of CriticRewardConfig and what is valid.
CRITIC_BOUNDS: dict[str, Bound] = {
    "positive_reward_value": Bound(),
    "negative_reward_value": Bound(),
    "outside_span_reward_value": Bound(),
    "fuzzy_min_similarity": Bound(low=0.0, high=1.0, low_open=True),
    "intrinsic_reward_coef": Bound(
        low=0.0, fix="To reverse the critic's judgement swap positive_reward_value and negative_reward_value."
    ),
    "intrinsic_reward_max_sum": Bound(low=0.0, low_open=True, optional=True, fix="None: no bound."),
    "max_consecutive_failing_steps": Bound(low=1, integer=True),
    **BACKEND_BOUNDS,
}
# What only the OpenAI-compatible backend reads.
OPENAI_FIELDS = (
    "critic_base_url", "critic_api_key_env", "critic_concurrency", "critic_max_concurrency", "critic_retry_after_max",
    "critic_cache_dir", "critic_timeout", "critic_transport", "critic_max_retries", "critic_rate_limit",
    "critic_temperature",
)  # fmt: skip


@dataclass
class CriticBackendConfig(SecretsNotPickled):
    """Which critic answers and how it is reached: the backend, its model, and the OpenAI-compatible transport's
    settings (URL, key variable, concurrency, timeouts, retries, rate limit, cache)."""

    critic_backend: str = option(
        "lexicon", "'openai' (any OpenAI-compatible server), 'transformers' (local model) or 'lexicon'."
    )
    critic_model: str | None = option(
        None, "Served model name (openai; default gpt-4o-mini) or local path (transformers)."
    )
    critic_lexicon: str = option(
        "vader",
        "Word list of the lexicon sentiment critic: 'vader' (the environment reward's own) or 'afinn' "
        "(AFINN-165, an independent list; pip install afinn).",
    )
    critic_base_url: str | None = option(
        None, "Base URL of an OpenAI-compatible server, e.g. http://localhost:8000/v1 (vLLM)."
    )
    critic_api_key_env: str = option(
        "OPENAI_API_KEY",
        "Name of the environment variable holding the critic API key (a value that looks like a key is "
        "refused, without repeating it).",
    )
    critic_concurrency: int | None = option(
        None, "Critic requests in flight (openai); None: the whole batch, up to critic_max_concurrency."
    )
    critic_max_concurrency: int = option(
        256, "Most critic requests in flight at once when critic_concurrency is None (openai)."
    )
    critic_retry_after_max: float = option(
        60.0, "Longest wait (s) a critic server's Retry-After may ask for (openai); longer is cut."
    )
    critic_cache_dir: str | None = option(
        None, "Directory of the on-disk critic answer cache (openai); None: memory only."
    )
    critic_timeout: float = option(30.0, "Seconds per critic request (openai).")
    critic_transport: str = option(
        "http",
        "HTTP client of the openai backend: 'http' (httpx; proxies and TLS from the environment) or "
        "'openai' (the OpenAI SDK, slower: more CPU per request).",
    )
    critic_max_retries: int = option(4, "Retries of a critic request on 429/5xx/timeout/connection errors (openai).")
    critic_rate_limit: float | None = option(
        None, "Most critic requests started per second (openai); None: unlimited."
    )
    critic_max_tokens: int = option(128, "Longest critic answer, in tokens (openai, transformers).")
    critic_temperature: float = option(0.0, "Critic sampling temperature (openai).")
    critic_batch_size: int = option(8, "Prompts per generate call (transformers).")

    def backend_dependents(self) -> tuple[Dependent, ...]:
        """The backend fields and the `critic_backend` that reads them (checked by `build_critic_backend`)."""
        backend = self.critic_backend
        return (
            Dependent(OPENAI_FIELDS, backend == "openai", "critic_backend='openai'"),
            Dependent(("critic_model", "critic_max_tokens"), backend != "lexicon", "an LLM critic_backend"),
            Dependent(("critic_batch_size",), backend == "transformers", "critic_backend='transformers'"),
            Dependent(("critic_lexicon",), backend == "lexicon", "critic_backend='lexicon'"),
        )

    def __post_init__(self) -> None:
        for name, allowed in (("critic_backend", CRITIC_BACKENDS), ("critic_lexicon", SENTIMENT_LEXICONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}.")
        check_transport("critic_transport", self.critic_transport)
        # every *_env field (critic_api_key_env): the key itself typed there would be echoed by errors and saved
        super().__post_init__()


@dataclass
class CriticRewardConfig(CriticBackendConfig):
    """The dense intrinsic reward from an LLM critic: what the critic's answers become, plus the backend's fields.
    `continuation_header` and `parse_answer` are the answer format read (`RelcCriticRewardConfig` adds RELC's)."""

    continuation_header = staticmethod(continuation_header)
    parse_answer = staticmethod(parse_critic_answer)

    use_intrinsic_reward: bool = option(
        False, "Add the critic's per-token intrinsic rewards to the environment reward."
    )
    critic_task: str = option(
        "sentiment", "Answer format and default prompt/lexicon: 'sentiment', 'toxicity' or 'summarization'."
    )
    positive_reward_value: float = option(0.5, "Reward of a token inside a positive span.")
    negative_reward_value: float = option(-0.5, "Reward of a token inside a negative (toxic, flawed) span.")
    outside_span_reward_value: float = option(
        0.0, "Reward of a token inside no span of a parsed critique (e.g. 0.1: every non-toxic token)."
    )
    fuzzy_span_matching: bool = option(
        False, "Match spans the critic reworded by similarity (pip install 'trl_stable[fuzzy]')."
    )
    fuzzy_min_similarity: float = option(
        0.85, "Similarity floor in (0, 1] of a fuzzy match (rapidfuzz partial_ratio / 100)."
    )
    intrinsic_reward_threshold: float = option(
        10.0,
        "Critique completions whose environment reward is <= this (RELC: sentiment 10, toxicity 1.0, "
        "summarization 100; inf: all).",
    )
    intrinsic_reward_coef: float = option(1.0, "Factor, >= 0, on every token's intrinsic reward (RELC: 1).")
    intrinsic_reward_max_sum: float | None = option(
        None,
        "Bound, > 0, on a sample's absolute intrinsic sum (after the coef); a row above it is scaled down "
        "to it (e.g. 1.0 for a reward in [-1, 1]). None: no bound (RELC).",
    )
    prompt_file: str | None = option(
        None, "Few-shot critic template with a '{}'; default trl_stable/prompts/critic_<task>.txt."
    )
    critic_include_prompt: bool = option(
        True, "Show the critic the prompt and the completion (RELC); only the completion is rewarded."
    )
    max_consecutive_failing_steps: int = option(
        5, "Stop with an error after this many steps in a row without a usable critic answer."
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
