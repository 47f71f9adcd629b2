"""`CriticBackend`: the interface of every critic, critic prompts in, answers (None for a failed request) out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from trl_stable.rewards.critic.counters import CriticCounters
from trl_stable.rewards.critic.jobs import CriticJob


def non_blank(answer: str) -> bool:
    """The default answer validator: any answer with text."""
    return bool(answer.strip())


class CriticBackend(ABC):
    """A critic: ``generate(prompts, texts=None) -> answers``, None for a failed request; `texts` are the raw texts
    under critique, which the lexicon critic annotates (LLM backends read the prompts).

    Args:
        answer_validator: Which answers a caching backend may keep (default: any with text).
        validator_version: Stored with each disk-cache entry; an entry of another version is validated again.
    """

    name: str = "critic"
    concurrent: bool = False

    def __init__(
        self, answer_validator: Callable[[str], bool] | None = None, validator_version: str = "non-blank"
    ) -> None:
        self.counters = CriticCounters()
        self.answer_validator = answer_validator or non_blank
        self.validator_version = str(validator_version)

    def fatal_error(self) -> str | None:
        """Why no later request can succeed (the server rejected the key), which the reward raises at once."""
        return None

    @abstractmethod
    def generate(self, prompts: Sequence[str], texts: Sequence[str] | None = None) -> list[str | None]: ...

    def submit(self, prompts: Sequence[str], texts: Sequence[str] | None = None) -> CriticJob:
        """Start answering `prompts`; by default synchronously (backends with real concurrency override this)."""
        return CriticJob(answers=self.generate(prompts, texts))

    def __call__(self, prompts: Sequence[str], texts: Sequence[str] | None = None) -> list[str | None]:
        return self.generate(prompts, texts)

    def metrics(self) -> dict[str, float]:
        """Cumulative counters as ``critic/<name>`` floats."""
        return {f"critic/{k}": float(v) for k, v in self.counters.snapshot().items()}

    def close(self) -> None:  # noqa: B027 - optional hook: most backends hold nothing to release
        """Release threads and connections (idempotent)."""

    def __enter__(self) -> CriticBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
