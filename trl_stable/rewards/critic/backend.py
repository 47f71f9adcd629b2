"""`CriticBackend`: the interface of every critic, a list of critic prompts in and a list of answers (None for a
failed request) out. Backends with real concurrency return from `submit` before the answers arrive."""

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
    """A critic: ``generate(prompts) -> answers`` with None for a failed request.

    Args of `generate`/`submit`:
        prompts: The formatted critic prompts.
        texts: The raw texts under critique, one per prompt. LLM backends read the prompt and ignore them; the
            lexicon critic, which cannot read a few-shot prompt, annotates them.

    Args:
        answer_validator: Which answers may be cached (backends with a cache): default any answer with text.
            `CriticIntrinsicReward` builds its backend with its span parser here, so garbage is asked again.
        validator_version: Stored with each disk-cache entry: an entry written under another version is validated
            again before it is served, so a parser change cannot keep serving answers the old parser accepted.
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
        """A reason no later request can succeed (e.g. the server rejected the API key); None while there is none.

        The reward function raises it at once instead of paying `max_consecutive_failing_steps` failing steps."""
        return None

    @abstractmethod
    def generate(self, prompts: Sequence[str], texts: Sequence[str] | None = None) -> list[str | None]: ...

    def submit(self, prompts: Sequence[str], texts: Sequence[str] | None = None) -> CriticJob:
        """Start answering `prompts`; by default synchronously (backends with real concurrency override this)."""
        return CriticJob(answers=self.generate(prompts, texts))

    def __call__(self, prompts: Sequence[str], texts: Sequence[str] | None = None) -> list[str | None]:
        return self.generate(prompts, texts)

    def metrics(self) -> dict[str, float]:
        """Cumulative counters as ``critic/<name>`` floats (requests, failures, retries, cache hits, tokens...)."""
        return {f"critic/{k}": float(v) for k, v in self.counters.snapshot().items()}

    def close(self) -> None:  # noqa: B027 - optional hook: most backends hold nothing to release
        """Release threads and connections (idempotent)."""

    def __enter__(self) -> CriticBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
