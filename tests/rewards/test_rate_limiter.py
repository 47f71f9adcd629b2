import threading
import time

import pytest

from trl_stable.rewards.critic.rate_limit import RateLimiter


def test_rate_limiter_spaces_acquisitions_evenly():
    limiter = RateLimiter(50.0)  # one start every 20 ms
    start = time.monotonic()
    for _ in range(4):
        limiter.acquire()
    # the first start is immediate, the next three wait 20 ms each
    assert time.monotonic() - start >= 3 * 0.02 - 1e-3


def test_rate_limiter_stop_event_ends_the_wait():
    limiter = RateLimiter(0.1)  # a 10 s gap between starts
    stop = threading.Event()
    limiter.acquire(stop)
    stop.set()
    start = time.monotonic()
    limiter.acquire(stop)
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("rate", [0.0, -1.0])
def test_rate_limiter_rejects_non_positive_rates(rate):
    with pytest.raises(ValueError, match="rate must be > 0"):
        RateLimiter(rate)


def test_reserve_books_slots_without_sleeping():
    limiter = RateLimiter(0.01)  # one start every 100 s
    assert limiter.reserve() == 0.0  # the first slot is now
    wait = limiter.reserve()  # the next one is booked 100 s after the first
    assert 99.0 < wait <= 100.0


def test_acquire_returns_the_booked_slots_one_interval_apart():
    limiter = RateLimiter(200.0)
    slots = [limiter.acquire() for _ in range(4)]
    assert all(b - a >= limiter.interval - 1e-12 for a, b in zip(slots, slots[1:]))
