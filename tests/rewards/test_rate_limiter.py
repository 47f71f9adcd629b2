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
