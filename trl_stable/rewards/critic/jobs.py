"""`CriticJob`: the pending answers of one `CriticBackend.submit` call."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from trl_stable.rewards.critic.counters import CriticCounters


class Unsent:
    """The prompts of one batch whose request is not on the wire yet: `sent(k)` once prompt k's request body is
    written (again on a retry: idempotent) or it ended without one (a cache hit, a failure); `wait` for none left.
    `on_none_left` is called once, when the last of `n` > 0 prompts is sent."""

    def __init__(self, n: int, on_none_left: Callable[[], None] | None = None) -> None:
        self._left = set(range(n))
        self._lock = threading.Lock()
        self._none_left = threading.Event()
        self._on_none_left = on_none_left
        if not n:
            self._none_left.set()

    def sent(self, k: int) -> None:
        with self._lock:
            self._left.discard(k)
            if not self._left and not self._none_left.is_set():
                if self._on_none_left is not None:  # before `wait` returns
                    self._on_none_left()
                self._none_left.set()

    def wait(self, timeout: float | None) -> bool:
        return self._none_left.wait(timeout)


class CriticJob:
    """The pending answers of one `CriticBackend.submit` call; requests still running at the deadline are None,
    counted as ``deadline_exceeded`` (a hung critic cannot stall training). `unsent`: tracks when every request is
    on the wire (`wait_sent`); a job without it counts as sent."""

    def __init__(
        self,
        futures: Sequence[cf.Future] | None = None,
        answers: Sequence[str | None] | None = None,
        counters: CriticCounters | None = None,
        deadline: float | None = None,
        unsent: Unsent | None = None,
    ) -> None:
        self._futures = list(futures) if futures is not None else None
        self._answers = list(answers) if answers is not None else None
        self._counters = counters if counters is not None else CriticCounters()  # a job of its own: counted nowhere
        self._deadline = deadline
        self._unsent = unsent

    def done(self) -> bool:
        return self._futures is None or all(f.done() for f in self._futures)

    def wait_sent(self) -> None:
        """Return once every request is on the wire or ended (at the latest at the deadline): work done after it
        does not hold the GIL that the worker threads need to send."""
        if self._unsent is not None:
            self._unsent.wait(None if self._deadline is None else max(0.0, self._deadline - time.monotonic()))

    def as_completed(self, timeout: float | None = None) -> Iterator[tuple[int, str | None]]:
        """(prompt index, answer) pairs as the answers arrive, each index once; at the deadline (or `timeout`) the
        unanswered ones follow as None."""
        if self._answers is not None:
            yield from enumerate(list(self._answers))
            return
        left = None if self._deadline is None else self._deadline - time.monotonic()
        limits = [t for t in (timeout, left) if t is not None]
        wait_s = max(0.0, min(limits)) if limits else None
        answers: list[str | None] = [None] * len(self._futures)
        index: dict[cf.Future, list[int]] = {}
        for i, fut in enumerate(self._futures):  # a deduplicated request is one future for several prompts
            index.setdefault(fut, []).append(i)
        pending = set(index)
        try:
            for fut in cf.as_completed(index, timeout=wait_s):
                pending.discard(fut)
                answer = fut.result() if not fut.cancelled() and fut.exception() is None else None
                for i in index[fut]:
                    answers[i] = answer
                    if answer is None:  # an answer the caller did not get, whatever the reason
                        self._counters.add("failures")
                    yield i, answer
        except cf.TimeoutError:
            pass
        for fut in pending:
            fut.cancel()  # past the deadline: a queued request is never sent, a running one is abandoned
            for i in index[fut]:
                self._counters.add("deadline_exceeded")
                self._counters.add("failures")
                yield i, None
        self._answers = answers

    def result(self, timeout: float | None = None) -> list[str | None]:
        """The answers, in prompt order; None where a request failed or was still running at the deadline."""
        if self._answers is None:
            list(self.as_completed(timeout))
        return list(self._answers)
