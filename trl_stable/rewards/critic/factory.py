"""`build_critic_backend`: the backend a `CriticRewardConfig` names, built with the answer validator it caches by."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from trl_stable.rewards.critic.backend import CriticBackend
from trl_stable.rewards.critic.config import OPENAI_FIELDS, CriticBackendConfig, CriticRewardConfig
from trl_stable.rewards.critic.lexicon import LexiconCritic
from trl_stable.rewards.critic.local import TransformersCritic
from trl_stable.rewards.critic.openai_critic import OpenAICritic
from trl_stable.settings.checks import check_dependents, field_default
from trl_stable.settings.secrets import redact

logger = logging.getLogger(__name__)


def warn_ignored_backend_fields(config: CriticRewardConfig, backend: Any) -> None:
    """Warn, naming them, about the backend fields `config` sets that a backend object passed in makes moot."""
    ignored = [
        f"{f.name}={redact(getattr(config, f.name))!r}"
        for f in dataclasses.fields(CriticBackendConfig)
        if getattr(config, f.name) != field_default(config, f.name)
    ]
    if ignored:
        logger.warning(
            "%s: ignored, the backend object passed as backend= (%s) answers the critic prompts; unset them.",
            ", ".join(ignored),
            type(backend).__name__,
        )


def build_critic_backend(
    config: CriticRewardConfig,
    model: Any = None,
    tokenizer: Any = None,
    answer_validator: Callable[[str], bool] | None = None,
    validator_version: str = "non-blank",
) -> CriticBackend:
    """The backend `config` asks for; `model`/`tokenizer` are the local critic (e.g. the policy) for 'transformers';
    `answer_validator` / `validator_version` decide which answers a caching backend keeps (see `CriticBackend`).
    A backend field set for a backend that does not read it is named in a warning (the research scripts' defaults
    set some of them for every backend)."""
    check_dependents(config, config.backend_dependents(), warn=logger.warning)
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
            max_tokens=config.critic_max_tokens,
            answer_validator=answer_validator,
            validator_version=validator_version,
            **{name.removeprefix("critic_"): getattr(config, name) for name in OPENAI_FIELDS},
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
