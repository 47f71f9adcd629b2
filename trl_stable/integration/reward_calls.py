"""Calling a reward function as TRL does: async functions awaited on an event loop of TRL's own kind.

Both trainers call reward functions through here (GRPO its dense ones, after TRL's own `_calculate_rewards`; PPO all
of them), so an async reward function works the same in both.
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
from collections.abc import Callable, Sequence
from typing import Any


def call_reward_func(func: Callable[..., Any], loop: asyncio.AbstractEventLoop | None, **kwargs: Any) -> Any:
    """Call a reward function; an async one runs on `loop`, as TRL runs them on its reward event loop.

    GRPO passes TRL's `async_loop`; PPO its own loop from TRL's `start_event_loop_in_daemon` (`reward_event_loop`),
    so an async reward function also works where an event loop is already running (a notebook).
    """
    from trl.trainer.utils import is_async_callable

    out = func(**kwargs)
    if is_async_callable(func) or inspect.isawaitable(out):
        if loop is None:
            raise RuntimeError(f"Reward function {func!r} is async but no event loop was started for it.")
        out = asyncio.run_coroutine_threadsafe(out, loop).result()
    return out


def reward_event_loop(funcs: Sequence[Callable[..., Any]]) -> asyncio.AbstractEventLoop | None:
    """A daemon-thread event loop for the async functions among `funcs` (TRL's helper), None when there are none."""
    from trl.trainer.utils import is_async_callable, shutdown_event_loop_in_daemon, start_event_loop_in_daemon

    if not any(is_async_callable(f) for f in funcs):
        return None
    thread, loop, ready = start_event_loop_in_daemon(name="trl_stable-reward-loop")
    ready.wait()
    atexit.register(shutdown_event_loop_in_daemon, thread, loop)
    return loop
