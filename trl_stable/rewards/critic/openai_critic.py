"""`OpenAICritic`: a critic served by any OpenAI-compatible chat-completions API (OpenAI, a vLLM server, ...)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import logging
import math
import os
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from trl_stable.rewards.critic.backend import CriticBackend
from trl_stable.rewards.critic.cache import AnswerCache, cache_key
from trl_stable.rewards.critic.config import BACKEND_BOUNDS
from trl_stable.rewards.critic.jobs import CriticJob, Unsent
from trl_stable.rewards.critic.rate_limit import RateLimiter
from trl_stable.rewards.critic.transport import HTTPXChatClient, SDKChatClient, check_transport, classify
from trl_stable.settings.checks import check_bounds
from trl_stable.settings.secrets import Secret, check_env_var_name, redact_text

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://api.openai.com/v1"
_CHECKED = ("concurrency", "max_concurrency", "retry_after_max", "timeout", "max_retries", "rate_limit")


class OpenAICritic(CriticBackend):
    """A critic served by an OpenAI-compatible chat-completions API (OpenAI, a vLLM server, ...).

    Each prompt is one chat request (a user message, plus `system_prompt` if given), every request of a batch in
    flight at once. 429, 5xx, timeouts, connection errors and malformed responses are retried after
    ``min(backoff_max, backoff_base * 2**attempt) * U(0.5, 1)`` seconds, or after the server's Retry-After when it is
    longer (up to `retry_after_max`); a 401 / 403 stops every later request (`fatal_error` says why); other 4xx fail
    at once. A failed request is None, counted. Answers `answer_validator` accepts are cached in memory and, with
    `cache_dir`, on disk.

    Args:
        model, base_url, api_key_env, temperature, max_tokens, concurrency, max_concurrency, timeout, max_retries,
            retry_after_max, rate_limit, cache_dir, transport: The ``critic_*`` fields of `CriticBackendConfig`
            (`base_url` None: ``OPENAI_BASE_URL`` or OpenAI's).
        api_key: The key, instead of the environment variable `api_key_env`; never logged or saved.
        backoff_base, backoff_max: First and largest delay of our own exponential backoff, in seconds.
        system_prompt: Optional system message.
        batch_timeout: Seconds a whole batch may take; default `batch_seconds` (the worst case of its retries).
        seed: Seed of the backoff jitter.
        memory_cache_size: Answers kept in memory (least recently used evicted).
        answer_validator, validator_version: See `CriticBackend`.
    """

    name = "openai"
    concurrent = True  # submit() returns before the answers: prefetching overlaps critic latency with other work

    def __init__(
        self,
        model: str = "gpt-4o-mini",
        base_url: str | None = None,
        api_key: str | None = None,
        api_key_env: str = "OPENAI_API_KEY",
        temperature: float = 0.0,
        max_tokens: int = 128,
        concurrency: int | None = None,
        timeout: float = 30.0,
        max_retries: int = 4,
        backoff_base: float = 0.5,
        backoff_max: float = 8.0,
        retry_after_max: float = 60.0,
        rate_limit: float | None = None,
        cache_dir: str | os.PathLike | None = None,
        system_prompt: str | None = None,
        batch_timeout: float | None = None,
        seed: int | None = None,
        memory_cache_size: int = 4096,
        max_concurrency: int = 256,
        transport: str = "http",
        answer_validator: Callable[[str], bool] | None = None,
        validator_version: str = "non-blank",
    ) -> None:
        super().__init__(answer_validator, validator_version)
        check_transport("transport", transport)
        check_env_var_name("api_key_env", api_key_env)  # a key passed here would be echoed by the errors below
        key = api_key if api_key is not None else os.environ.get(api_key_env)
        self._key_from_env = api_key is None
        if not key:
            if base_url is None:
                raise ValueError(
                    f"No API key for the OpenAI critic: set the environment variable {api_key_env} "
                    "(or point critic_base_url at a local OpenAI-compatible server such as vLLM)."
                )
            key = "EMPTY"  # local servers (vLLM) accept any key
        self._api_key = Secret(key)
        self.model = model
        self.base_url = base_url
        self.transport = transport
        self.api_key_env = api_key_env
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.concurrency = concurrency
        self.max_concurrency = max_concurrency
        self.retry_after_max = retry_after_max
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.system_prompt = system_prompt
        self.batch_timeout = batch_timeout
        self.rate_limit = rate_limit
        check_bounds(self, {name: BACKEND_BOUNDS[f"critic_{name}"] for name in _CHECKED})
        self._rate = RateLimiter(rate_limit) if rate_limit else None
        self.cache = AnswerCache(
            self.counters, self.answer_validator, self.validator_version, model, memory_cache_size, cache_dir
        )
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        self._stop = threading.Event()
        self._client = None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._init_lock = threading.Lock()
        self._inflight: dict[str, cf.Future] = {}
        self._inflight_lock = threading.RLock()
        self._auth_error: str | None = None

    @property
    def workers(self) -> int:
        """Most requests in flight at once; with a rate limit, no more than can start within one `timeout`."""
        if self.concurrency is not None:
            return self.concurrency
        workers = self.max_concurrency
        if self.rate_limit:
            workers = min(workers, max(1, math.ceil(self.rate_limit * self.timeout)))
        return workers

    def fatal_error(self) -> str | None:
        return self._auth_error

    def __repr__(self) -> str:
        base_url = None if self.base_url is None else redact_text(self.base_url)
        return (
            f"OpenAICritic(model={self.model!r}, base_url={base_url!r}, api_key_env={self.api_key_env!r}, "
            f"concurrency={self.concurrency}, max_concurrency={self.max_concurrency}, timeout={self.timeout}, "
            f"max_retries={self.max_retries})"
        )

    def __getstate__(self):
        raise TypeError("OpenAICritic holds an API key and live connections; it cannot be pickled.")

    @property
    def params(self) -> dict[str, Any]:
        """The generation parameters in the cache key."""
        return {"temperature": self.temperature, "max_tokens": self.max_tokens, "system_prompt": self.system_prompt}

    def _redact(self, message: str) -> str:
        key = self._api_key.get()
        if key and key != "EMPTY":
            message = message.replace(key, "***")
        return re.sub(r"(?i)(bearer\s+)\S+", r"\1***", message)

    def _get_client(self):
        with self._init_lock:
            if self._client is None and self.transport == "http":
                url = self.base_url or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
                self._client = HTTPXChatClient(url, self._api_key.get())
            elif self._client is None:
                self._client = SDKChatClient(self.base_url, self._api_key.get(), self.timeout)
            if self._pool is None:
                # The executor starts a thread per queued task while it has no idle one, up to `workers`: a batch of
                # N gets N threads (kept for the next batches), not a fixed pool that runs it in waves.
                self._pool = cf.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="critic")
            return self._client

    def _sleep(self, seconds: float) -> bool:
        """Wait `seconds` (a backoff, a rate-limit slot); True when the critic was closed meanwhile."""
        return self._stop.wait(seconds)

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        with self._rng_lock:
            jitter = 0.5 + 0.5 * self._rng.random()
        delay = min(self.backoff_max, self.backoff_base * (2**attempt)) * jitter
        if retry_after is None:
            return delay
        # The server knows when it will take requests again; our own backoff cap must not cut that short (8 s
        # against a 20 s Retry-After hits it three more times for nothing). Only `retry_after_max` does.
        wait = min(retry_after, self.retry_after_max)
        if retry_after > self.backoff_max:
            cut = f" (more than retry_after_max={self.retry_after_max:g})" if wait < retry_after else ""
            logger.warning("The critic server asked to retry after %.1f s%s; waiting %.1f s.", retry_after, cut, wait)
        return max(delay, wait)

    def _ask(self, prompt: str, key: str, deadline: float, on_sent: Callable[[], None]) -> str | None:
        """The answer to one prompt (cache `key`): from the cache, else requested with retries until `deadline`; None
        on failure. `on_sent` is called once the request is on the wire."""
        cached = self.cache.get(key)
        if cached is not None:
            self.counters.add("successes")
            return cached
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages = [*system, {"role": "user", "content": prompt}]
        payload = dict(model=self.model, messages=messages, temperature=self.temperature, max_tokens=self.max_tokens)
        last_error, attempts = "no attempt", 0
        for attempt in range(self.max_retries + 1):
            if self._stop.is_set():
                break
            if self._auth_error is not None:  # the key was rejected: every further call would be too
                last_error = "the server rejected the API key"
                break
            wait = self._rate.reserve() if self._rate is not None else 0.0
            if wait > 0 and self._sleep(wait):
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                last_error = "batch deadline reached"
                break
            self.counters.add("attempts")
            attempts += 1
            try:
                answer, usage = self._get_client().create(payload, min(self.timeout, remaining), on_sent)
            except Exception as exc:  # noqa: BLE001 - every failure becomes a counted None, never a crash
                retryable = classify(exc)
                if retryable is None:
                    self.counters.add("client_errors")
                    status = getattr(exc, "status_code", None)
                    last_error = f"{type(exc).__name__} ({f'HTTP {status}' if status else type(exc).__name__})"
                    if status in (401, 403):
                        self.counters.add("auth_errors")
                        self._auth_error = self._auth_message(status)
                    break
                counter, retry_after = retryable
                self.counters.add(counter)
                last_error = f"{type(exc).__name__}: {self._redact(str(exc))[:200]}"
                if attempt == self.max_retries:
                    break
                delay = self._backoff(attempt, retry_after)
                if time.monotonic() + delay >= deadline:
                    break
                self.counters.add("retries")
                if self._sleep(delay):
                    break
                continue
            for name in ("prompt_tokens", "completion_tokens"):
                value = (usage or {}).get(name)
                self.counters.add(name, int(value) if isinstance(value, (int, float)) else 0)
            self.cache.put(key, answer)
            self.counters.add("successes")
            return answer
        logger.warning("Critic request failed after %d attempt(s): %s", attempts, last_error)
        return None

    def _auth_message(self, status: int) -> str:
        """Why the run must stop after a 401/403: names the key's source and the server, never the key."""
        source = f"the environment variable {self.api_key_env}" if self._key_from_env else "the api_key argument"
        url = redact_text(self.base_url) if self.base_url else f"{DEFAULT_BASE_URL} (OpenAI's default)"
        what = "rejected the API key" if status == 401 else "refused the API key access to this model"
        return (
            f"The critic server at {url} {what} (HTTP {status}). The key is read from {source}: check that it is "
            f"set to a valid key for that server (and critic_model={self.model!r}); critic_api_key_env names the "
            "variable."
        )

    def _guarded_ask(self, prompt: str, key: str, deadline: float, on_sent: Callable[[], None]) -> str | None:
        try:
            return self._ask(prompt, key, deadline, on_sent)
        except Exception as exc:  # noqa: BLE001 - a bug in one request must not take the batch down
            logger.warning("Critic request crashed: %s", self._redact(f"{type(exc).__name__}: {exc}")[:200])
            return None

    def submit(self, prompts: Sequence[str], texts: Sequence[str] | None = None) -> CriticJob:
        """Start the requests and return at once; a prompt identical to one in flight (sampled twice, or prefetched)
        joins that request (counted as ``deduplicated``)."""
        self._get_client()
        self._stop.clear()
        deadline = time.monotonic() + self.batch_seconds(len(prompts))
        self.counters.add("requests", len(prompts))
        if prompts:  # the disk cache writes once this batch is on the wire
            self.cache.pause_writes()
        futures, params, unsent = [], self.params, Unsent(len(prompts), on_none_left=self.cache.resume_writes)
        with self._inflight_lock:
            for k, prompt in enumerate(prompts):
                key = cache_key(self.model, prompt, params)
                fut = self._inflight.get(key)
                if fut is not None and not fut.done():
                    self.counters.add("deduplicated")
                    unsent.sent(k)  # its request is another prompt's
                else:
                    on_sent = functools.partial(unsent.sent, k)
                    fut = self._pool.submit(self._guarded_ask, prompt, key, deadline, on_sent)
                    self._inflight[key] = fut
                    fut.add_done_callback(functools.partial(self._forget, key, on_sent))
                futures.append(fut)
        return CriticJob(futures=futures, counters=self.counters, deadline=deadline + 1.0, unsent=unsent)

    def batch_seconds(self, n: int) -> float:
        """How long a batch of `n` prompts may take before its unanswered requests count as failed."""
        if self.batch_timeout is not None:
            return self.batch_timeout
        longest_wait = max(self.backoff_max, self.retry_after_max)  # a Retry-After can ask for up to retry_after_max
        one = self.timeout * (self.max_retries + 1) + longest_wait * self.max_retries + 5.0
        waves = -(-n // self.workers) - 1  # requests beyond `workers` queue behind the pool
        spacing = n / self.rate_limit if self.rate_limit else 0.0
        return one + max(waves, 0) * self.timeout + spacing

    def _forget(self, key: str, on_sent: Callable[[], None], fut: cf.Future) -> None:
        on_sent()  # for a request that ended unsent: a cache hit, a failure, a cancel
        with self._inflight_lock:  # re-entrant: the callback runs inline when the future is already done
            if self._inflight.get(key) is fut:
                del self._inflight[key]
            idle = not self._inflight
        if idle:  # the last request of the batches in flight: the disk cache writes while nothing waits on it
            self.cache.write_pending()

    def generate(self, prompts: Sequence[str], texts: Sequence[str] | None = None) -> list[str | None]:
        answers = self.submit(prompts, texts).result()
        self.cache.flush()  # a caller that asks again (or restarts) finds every answer on disk
        return answers

    def close(self) -> None:
        """End every wait, drop the queued requests, write the cache and close the connections."""
        self._stop.set()
        self.cache.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
            self._client = None
