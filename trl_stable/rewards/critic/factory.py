"""`build_critic_backend`: the backend a `CriticRewardConfig` names, built with the answer validator it caches by."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trl_stable.rewards.critic.backend import CriticBackend
from trl_stable.rewards.critic.config import CriticRewardConfig
from trl_stable.rewards.critic.lexicon import LexiconCritic
from trl_stable.rewards.critic.local import TransformersCritic
from trl_stable.rewards.critic.openai_critic import OpenAICritic


def build_critic_backend(
    config: CriticRewardConfig,
    model: Any = None,
    tokenizer: Any = None,
    answer_validator: Callable[[str], bool] | None = None,
    validator_version: str = "non-blank",
) -> CriticBackend:
    """The backend `config` asks for; `model`/`tokenizer` are the local critic (e.g. the policy) for 'transformers';
    `answer_validator` / `validator_version` decide which answers a caching backend keeps (see `CriticBackend`)."""
    if config.critic_backend == "lexicon":
        if config.critic_task == "summarization":
            raise ValueError(
                "critic_backend='lexicon' has no summarization lexicon; use critic_backend='openai' or "
                "'transformers' for critic_task='summarization', or pass a backend object."
            )
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
            answer_validator=answer_validator,
            validator_version=validator_version,
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
