"""`RateLimiter`: at most `rate` request starts per second, evenly spaced, shared by every caller."""

from __future__ import annotations

import threading
import time


class RateLimiter:
    """At most `rate` (> 0) request starts per second, evenly spaced (a token bucket of depth one), shared by all
    callers: `reserve` books the next slot and says how long to wait for it, `acquire` books it and sleeps."""

    def __init__(self, rate: float) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be > 0 requests per second, got {rate}.")
        self.interval = 1.0 / rate
        self._lock = threading.Lock()
        self._next = 0.0

    def _book(self) -> tuple[float, float]:
        """(the next free slot, now), booking the slot."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + self.interval
        return start, now

    def reserve(self) -> float:
        """Book the next free slot; the seconds until it starts (0 when it is now)."""
        start, now = self._book()
        return start - now

    def acquire(self, stop: threading.Event | None = None) -> float:
        """Block until this caller's slot and return it (a `time.monotonic` time); a set `stop` event ends the wait
        early (e.g. on close)."""
        start, now = self._book()
        if start > now:
            (time.sleep if stop is None else stop.wait)(start - now)
        return start
