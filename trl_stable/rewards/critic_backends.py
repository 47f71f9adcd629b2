"""Critic backends: a list of critic prompts in, a list of answers (or None for a failed request) out.

Three backends share one interface (`CriticBackend`):

- `OpenAICritic`: any OpenAI-compatible chat-completions server (OpenAI, vLLM, ...), with a thread pool, retries with
  exponential backoff and jitter, a per-request timeout, a rate limit and an on-disk answer cache;
- `TransformersCritic`: a local causal LM (the policy itself for self-critique, or any other), batched greedy decoding;
- `LexiconCritic`: no model and no network. It answers in exactly the LLM answer format, from a sentiment lexicon
  (VADER: Hutto & Gilbert, ICWSM 2014; or AFINN-165: Nielsen, ESWC 2011 workshop "Making Sense of Microposts") or
  alt-profanity-check, so the same parsing path runs offline.

RELC (Cao et al., EMNLP 2024) queried its critic with 2 workers, serially per batch, with no retry budget, no timeout
and no cache; a failed call returned None and crashed its parser. Here a failed request is None, counted, and the
caller gives that sample zero intrinsic reward.
"""

from __future__ import annotations

import concurrent.futures as cf
import email.utils
import hashlib
import json
import logging
import math
import os
import random
import re
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from typing import Any

from trl_stable.redaction import check_env_var_name
from trl_stable.rewards import chat_http

logger = logging.getLogger(__name__)

COUNTER_NAMES = (
    "requests",  # answers asked for (cache hits included)
    "attempts",  # HTTP calls / generate batches actually made
    "retries",
    "successes",
    "failures",  # requests that ended without an answer (None)
    "cache_hits",
    "deduplicated",  # identical prompts that joined a request already in flight
    "timeouts",
    "rate_limited",
    "server_errors",
    "connection_errors",
    "bad_responses",
    "client_errors",
    "auth_errors",  # 401 / 403: the key is wrong; the reward function stops the run at the first one
    "deadline_exceeded",
    "cache_refused",  # answers not cached because the answer validator (the span parser) rejected them
    "cache_revalidated",  # disk entries of another parser version that the current validator accepted again
    "prompt_tokens",
    "completion_tokens",
)


class CriticCounters:
    """Thread-safe cumulative counters of a critic backend."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTER_NAMES, 0)

    def add(self, name: str, value: int = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + value

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def restore(self, values: dict[str, int]) -> None:
        """Continue from a `snapshot()` (a resumed run's counters go on from the checkpoint's)."""
        with self._lock:
            self._values = {**dict.fromkeys(COUNTER_NAMES, 0), **{k: int(v) for k, v in values.items()}}


class CriticJob:
    """The pending answers of one `CriticBackend.submit` call.

    `result` never waits past its deadline: requests still running then are reported as None (and counted as
    ``deadline_exceeded``), so a hung critic cannot stall training.
    """

    def __init__(
        self,
        futures: Sequence[cf.Future] | None = None,
        answers: Sequence[str | None] | None = None,
        counters: CriticCounters | None = None,
        deadline: float | None = None,
    ) -> None:
        self._futures = list(futures) if futures is not None else None
        self._answers = list(answers) if answers is not None else None
        self._counters = counters
        self._deadline = deadline

    def done(self) -> bool:
        return self._futures is None or all(f.done() for f in self._futures)

    def as_completed(self, timeout: float | None = None) -> Iterator[tuple[int, str | None]]:
        """(prompt index, answer) pairs in the order the answers arrive, so the caller can parse one while the others
        are still in flight; at the deadline (or `timeout`) the unanswered ones follow as None. Every index comes out
        exactly once; the answers are kept for `result`."""
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
                    self._count_missing(answer)
                    yield i, answer
        except cf.TimeoutError:
            pass
        for fut in pending:
            fut.cancel()  # a request still running finishes on its own (its timeout), unseen by this batch
            for i in index[fut]:
                if self._counters is not None:
                    self._counters.add("deadline_exceeded")
                self._count_missing(None)
                yield i, None
        self._answers = answers

    def _count_missing(self, answer: str | None) -> None:
        # "failures" counts the answers the caller did not get, whatever the reason
        if answer is None and self._counters is not None:
            self._counters.add("failures")

    def result(self, timeout: float | None = None) -> list[str | None]:
        """The answers, in prompt order; None where a request failed or was still running at the deadline."""
        if self._answers is None:
            for _ in self.as_completed(timeout):
                pass
        return list(self._answers)


class CriticBackend(ABC):
    """A critic: ``generate(prompts) -> answers`` with None for a failed request.

    Args of `generate`/`submit`:
        prompts: The formatted critic prompts.
        texts: The raw texts under critique, one per prompt. LLM backends read the prompt and ignore them; the
            lexicon critic, which cannot read a few-shot prompt, annotates them.
    """

    name: str = "critic"
    concurrent: bool = False

    def __init__(self) -> None:
        self.counters = CriticCounters()
        self.answer_validator: Callable[[str], bool] = _non_blank
        self.validator_version = "non-blank"

    def set_answer_validator(self, validator: Callable[[str], bool], version: str) -> None:
        """Cache only the answers `validator` accepts (the reward function installs its span parser here).

        `version` is stored with each disk-cache entry: an entry written under another version is checked again
        before it is served, so a parser change cannot keep serving answers validated by the old parser.
        """
        self.answer_validator = validator
        self.validator_version = str(version)

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


def _non_blank(answer: str) -> bool:
    return bool(answer.strip())


# --------------------------------------------------------------------------------------------------------------------
# OpenAI-compatible backend


class RateLimiter:
    """At most `rate` request starts per second, evenly spaced (a token bucket of depth one), shared by all threads.

    Args:
        rate: Request starts per second, > 0.
    """

    def __init__(self, rate: float) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be > 0 requests per second, got {rate}.")
        self.interval = 1.0 / rate
        self._lock = threading.Lock()
        self._next = 0.0

    def acquire(self, stop: threading.Event | None = None) -> float:
        """Block until this caller's slot and return it (a `time.monotonic` time); a set `stop` event ends the wait
        early (e.g. on close)."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + self.interval
        if start > now:
            if stop is None:
                time.sleep(start - now)
            else:
                stop.wait(start - now)
        return start


class _MemoryCache:
    """The most recent answers in memory (least recently used evicted), so a long run does not grow without bound.

    It serves a batch that `prefetch` already paid for when no disk cache is configured.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._items: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str) -> str | None:
        with self._lock:
            if key not in self._items:
                return None
            self._items.move_to_end(key)
            return self._items[key]

    def put(self, key: str, answer: str) -> None:
        with self._lock:
            self._items[key] = answer
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


class DiskCache:
    """Answers on disk, one JSON file per key, so a restarted run does not pay for the same critique twice.

    Each entry records the version of the validator (the span parser) that accepted it; `OpenAICritic` re-checks
    entries of another version before serving them. The key is the SHA-256 of (model, prompt, generation
    parameters); the API key is never part of it or of a file.
    Writes are atomic (temporary file + rename), so concurrent threads and processes can share a directory.
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)
        os.makedirs(self.directory, exist_ok=True)

    @staticmethod
    def key(model: str, prompt: str, params: dict[str, Any]) -> str:
        blob = json.dumps({"model": model, "prompt": prompt, "params": params}, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key[:2], f"{key}.json")

    def get(self, key: str) -> str | None:
        """The cached answer of `key`, whatever version validated it (None: missing or torn)."""
        entry = self.get_entry(key)
        return None if entry is None else entry[0]

    def get_entry(self, key: str) -> tuple[str, str | None] | None:
        """(answer, the validator version it was stored under) of `key`; None when missing or torn."""
        try:
            with open(self._path(key), encoding="utf-8") as f:
                data = json.load(f)
            answer, version = data.get("answer"), data.get("parser_version")
        except (OSError, ValueError, AttributeError):
            return None  # missing or torn file: ask again
        if not isinstance(answer, str):
            return None
        return answer, version if isinstance(version, str) else None

    def put(self, key: str, answer: str, model: str, parser_version: str | None = None) -> None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                entry = {"model": model, "answer": answer, "parser_version": parser_version}
                json.dump(entry, f, ensure_ascii=False)
            os.replace(tmp, path)
        except OSError:
            logger.warning("Could not write the critic cache file in %s", self.directory)
            if os.path.exists(tmp):
                os.unlink(tmp)


class _Secret:
    """Holds the API key; prints as '***' so it cannot leak through repr, logs or saved configs."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def get(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "'***'"

    __str__ = __repr__

    def __reduce__(self):
        raise TypeError("The critic API key is not picklable; pass api_key_env instead.")


def _without_userinfo(url: str | None) -> str | None:
    """`url` with any ``user:password@`` part masked (a key can ride in a URL)."""
    return None if url is None else re.sub(r"(//)[^/@]+@", r"\1***@", url)


class _NonRetryable(Exception):
    pass


def parse_retry_after(headers: Any, now: float | None = None) -> float | None:
    """Seconds a server asked the client to wait, from its response headers; None when it did not say.

    Reads ``retry-after-ms`` (milliseconds, OpenAI's and Azure's), then ``Retry-After`` as delta-seconds or as an
    HTTP-date (RFC 9110 10.2.3; a date in the past is 0). Negative or unreadable values are ignored.

    Args:
        headers: A mapping with case-insensitive ``get`` (httpx headers) or a plain dict.
        now: The current POSIX time for HTTP-dates (default ``time.time()``).

    Example:
        >>> parse_retry_after({"retry-after-ms": "1500"}), parse_retry_after({"Retry-After": "20"})
        (1.5, 20.0)
    """
    if headers is None:
        return None
    lower = {str(k).lower(): v for k, v in headers.items()}
    ms = lower.get("retry-after-ms")
    if ms is not None:
        try:
            value = float(ms) / 1000.0
            if math.isfinite(value) and value >= 0:
                return value
        except (TypeError, ValueError):
            pass
    raw = lower.get("retry-after")
    if raw is None:
        return None
    raw = str(raw).strip()
    try:
        value = float(raw)
        return value if math.isfinite(value) and value >= 0 else None
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:  # HTTP-dates are GMT
        when = when.replace(tzinfo=timezone.utc)
    now = time.time() if now is None else now
    return max(0.0, when.timestamp() - now)


def _utc_http_date(posix: float) -> str:
    """`posix` as an HTTP-date (for tests and the fake server)."""
    return email.utils.format_datetime(datetime.fromtimestamp(posix, tz=timezone.utc), usegmt=True)


class OpenAICritic(CriticBackend):
    """A critic served by an OpenAI-compatible chat-completions API (OpenAI, a vLLM server, ...).

    Each prompt is one chat request (a user message, plus `system_prompt` if given). Requests run on a thread pool
    sized to the batch: every request of a batch is in flight at once, so a batch costs about one server latency
    (RELC's 2 workers cost N/2 of them), up to `max_concurrency` (and, with a `rate_limit`, to what the limit lets
    start within one `timeout`); `concurrency` sets a fixed number instead. 429, 5xx, timeouts, connection errors
    and malformed responses are retried up to `max_retries` times after ``min(backoff_max, backoff_base *
    2**attempt) * U(0.5, 1)`` seconds (exponential backoff with jitter), or after the server's ``Retry-After`` /
    ``retry-after-ms`` (seconds or HTTP-date) when it is longer, up to `retry_after_max`. 401 / 403 are counted as
    ``auth_errors``: no request is sent after the first one (`fatal_error` says why); other 4xx fail at once. Each
    request has a `timeout`, each batch a deadline (`batch_timeout`), so nothing blocks forever.

    Requests go through a lean standard-library client (`chat_http.ChatHTTPClient`, ``transport="http"``, the
    default): a batch's threads share one GIL, and the OpenAI SDK's per-request CPU (about 10x this client's) is what
    separates a batch from one server latency. ``transport="openai"`` uses the SDK instead.

    Answers are cached (memory, and disk with `cache_dir`) only when `answer_validator` accepts them (default: not
    blank; `CriticIntrinsicReward` installs its span parser), so a garbage answer is asked again next time.

    Args:
        model: Model name sent to the server.
        base_url: Server URL, e.g. ``http://localhost:8000/v1`` for vLLM; None for OpenAI.
        api_key: The key; default read from the environment variable `api_key_env`. Never logged or saved.
        api_key_env: Environment variable holding the key.
        temperature: Sampling temperature (0: deterministic critiques, cacheable).
        max_tokens: Answer length limit.
        concurrency: Requests in flight at once; None (default): as many as the batch has, up to
            `max_concurrency`.
        max_concurrency: Most requests in flight at once when `concurrency` is None.
        timeout: Seconds per HTTP request.
        max_retries: Retries per request after the first attempt.
        backoff_base: First backoff delay in seconds.
        backoff_max: Largest backoff delay in seconds (of our own exponential backoff).
        retry_after_max: Longest wait a server's Retry-After can ask for, in seconds; longer requests are cut to it
            (and logged).
        rate_limit: Most request starts per second (None: unlimited).
        cache_dir: Directory of the on-disk answer cache (None: in-memory cache only).
        system_prompt: Optional system message.
        batch_timeout: Seconds a whole batch may take; default: the worst case of one request's retries, plus a
            `timeout` per extra wave of `concurrency` requests and the rate limit's spacing of the batch.
        seed: Seed of the backoff jitter.
        memory_cache_size: Answers kept in memory (least recently used evicted).
        transport: ``"http"`` (the standard-library client) or ``"openai"`` (the OpenAI SDK).
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
    ) -> None:
        super().__init__()
        if transport not in ("http", "openai"):
            raise ValueError(f"transport must be 'http' (standard library) or 'openai' (the SDK), got {transport!r}.")
        if concurrency is not None and concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 or None (sized to the batch), got {concurrency}.")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}.")
        if not retry_after_max >= 0:
            raise ValueError(f"retry_after_max must be >= 0 seconds, got {retry_after_max}.")
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}.")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}.")
        if rate_limit is not None and rate_limit <= 0:
            raise ValueError(f"rate_limit must be > 0 requests per second or None, got {rate_limit}.")
        if memory_cache_size < 0:
            raise ValueError(f"memory_cache_size must be >= 0, got {memory_cache_size}.")
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
        self._api_key = _Secret(key)
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
        self._rate = RateLimiter(rate_limit) if rate_limit else None
        self._cache = DiskCache(cache_dir) if cache_dir is not None else None
        self._memory = _MemoryCache(memory_cache_size)
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
        """Most requests in flight at once: `concurrency`, else `max_concurrency`, and with a rate limit no more
        than can start within one `timeout` (more threads would only wait for the limiter)."""
        if self.concurrency is not None:
            return self.concurrency
        workers = self.max_concurrency
        if self.rate_limit:
            workers = min(workers, max(1, math.ceil(self.rate_limit * self.timeout)))
        return workers

    def fatal_error(self) -> str | None:
        return self._auth_error

    def __repr__(self) -> str:
        return (
            f"OpenAICritic(model={self.model!r}, base_url={_without_userinfo(self.base_url)!r}, "
            f"api_key_env={self.api_key_env!r}, "
            f"concurrency={self.concurrency}, max_concurrency={self.max_concurrency}, timeout={self.timeout}, "
            f"max_retries={self.max_retries})"
        )

    def __getstate__(self):
        raise TypeError("OpenAICritic holds an API key and live connections; it cannot be pickled.")

    @property
    def params(self) -> dict[str, Any]:
        """Generation parameters that change the answer (part of the cache key)."""
        return {"temperature": self.temperature, "max_tokens": self.max_tokens, "system_prompt": self.system_prompt}

    def _redact(self, message: str) -> str:
        key = self._api_key.get()
        if key and key != "EMPTY":
            message = message.replace(key, "***")
        return re.sub(r"(?i)(bearer\s+)\S+", r"\1***", message)

    def _get_client(self):
        with self._init_lock:
            if self._client is None and self.transport == "http":
                url = self.base_url or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1"
                self._client = chat_http.ChatHTTPClient(url, self._api_key.get())
            elif self._client is None:
                import openai

                # Retries are ours (counted, jittered, deadline-aware), so the SDK's own are off.
                self._client = openai.OpenAI(
                    api_key=self._api_key.get(), base_url=self.base_url, timeout=self.timeout, max_retries=0
                )
            if self._pool is None:
                # The executor starts a thread per queued task while it has no idle one, up to `workers`: a batch of
                # N gets N threads (kept for the next batches), not a fixed pool that runs it in waves.
                self._pool = cf.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="critic")
            return self._client

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        with self._rng_lock:
            jitter = 0.5 + 0.5 * self._rng.random()
        delay = min(self.backoff_max, self.backoff_base * (2**attempt)) * jitter
        if retry_after is not None:
            # The server knows when it will take requests again; our own backoff cap must not cut that short
            # (8 s against a 20 s Retry-After hits it three more times for nothing). Only `retry_after_max` does.
            asked = retry_after
            retry_after = min(retry_after, self.retry_after_max)
            if asked > self.backoff_max:
                logger.warning(
                    "The critic server asked to retry after %.1f s%s; waiting %.1f s.",
                    asked,
                    f" (more than retry_after_max={self.retry_after_max:g})" if asked > self.retry_after_max else "",
                    retry_after,
                )
            delay = max(delay, retry_after)
        return delay

    def _classify(self, exc: BaseException) -> tuple[str, float | None]:
        """(counter name, Retry-After seconds); raises `_NonRetryable` for errors a retry cannot fix."""
        if self.transport == "openai":
            import openai

            timeout_errors, connection_errors, status_errors = (
                openai.APITimeoutError,
                openai.APIConnectionError,
                openai.APIStatusError,
            )
        else:
            timeout_errors, connection_errors, status_errors = (
                chat_http.ChatTimeout,
                chat_http.ChatConnectionError,
                chat_http.ChatStatusError,
            )
        if isinstance(exc, timeout_errors):
            return "timeouts", None
        if isinstance(exc, connection_errors):
            return "connection_errors", None
        if isinstance(exc, chat_http.ChatBadResponse):
            return "bad_responses", None
        if isinstance(exc, status_errors):
            status = exc.status_code
            # A 503 may carry Retry-After too (RFC 9110); the other statuses' headers are read the same way.
            headers = getattr(exc, "headers", None) or getattr(getattr(exc, "response", None), "headers", None)
            retry_after = parse_retry_after(headers)
            if status == 429:
                return "rate_limited", retry_after
            if status >= 500 or status in (408, 409):
                return "server_errors", retry_after
            raise _NonRetryable(f"HTTP {status}") from None
        if isinstance(exc, (ValueError, KeyError, IndexError, AttributeError, TypeError)):
            return "bad_responses", None  # malformed JSON or a body without choices
        raise _NonRetryable(type(exc).__name__) from None

    def _valid(self, answer: str) -> bool:
        try:
            return bool(self.answer_validator(answer))
        except Exception:  # noqa: BLE001 - a validator bug must not fail the request; the answer is just not cached
            logger.warning("The critic answer validator raised; the answer is not cached.", exc_info=True)
            return False

    def _cached(self, key: str) -> str | None:
        answer = self._memory.get(key)  # only validated answers get there
        if answer is None and self._cache is not None:
            entry = self._cache.get_entry(key)
            if entry is not None:
                answer, version = entry
                if version != self.validator_version:
                    # Written (or validated) by another parser version: serve it only if this one accepts it too.
                    if self._valid(answer):
                        self.counters.add("cache_revalidated")
                        self._cache.put(key, answer, self.model, self.validator_version)
                    else:
                        answer = None
                if answer is not None:
                    self._memory.put(key, answer)
        if answer is not None:
            self.counters.add("cache_hits")
            self.counters.add("successes")
        return answer

    def _remember(self, key: str, answer: str, usage: Any) -> None:
        if usage is not None:
            for name in ("prompt_tokens", "completion_tokens"):
                value = usage.get(name) if isinstance(usage, dict) else getattr(usage, name, 0)
                self.counters.add(name, int(value or 0) if isinstance(value, (int, float)) else 0)
        # Only answers the validator accepts are kept: a cached garbage answer would be served to every later step
        # and every restarted run, even after the server is healthy again.
        if self._valid(answer):
            self._memory.put(key, answer)
            if self._cache is not None:
                self._cache.put(key, answer, self.model, self.validator_version)
        else:
            self.counters.add("cache_refused")
        self.counters.add("successes")

    def _request(self, messages: list[dict[str, str]], timeout: float) -> tuple[str, Any]:
        """One chat-completions call: (answer text, usage); raises on any failure, a body without text included."""
        if self.transport == "http":
            payload = {
                "model": self.model,
                "messages": messages,
                "temperature": self.temperature,
                "max_tokens": self.max_tokens,
            }
            return self._get_client().create(payload, timeout)
        resp = self._get_client().chat.completions.create(
            model=self.model,
            messages=messages,
            temperature=self.temperature,
            max_tokens=self.max_tokens,
            timeout=timeout,
        )
        answer = resp.choices[0].message.content
        if not isinstance(answer, str):
            raise TypeError("answer without text content")
        return answer, getattr(resp, "usage", None)

    def _ask(self, prompt: str, deadline: float) -> str | None:
        """The answer to one prompt: from the cache, else requested with retries until `deadline`; None on failure."""
        key = DiskCache.key(self.model, prompt, self.params)
        cached = self._cached(key)
        if cached is not None:
            return cached
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [
            {"role": "user", "content": prompt}
        ]
        last_error, attempts = "no attempt", 0
        for attempt in range(self.max_retries + 1):
            if self._stop.is_set():
                break
            if self._auth_error is not None:  # the key was rejected: every further call would be too
                last_error = "the server rejected the API key"
                break
            if self._rate is not None:
                self._rate.acquire(self._stop)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                last_error = "batch deadline reached"
                break
            self.counters.add("attempts")
            attempts += 1
            try:
                answer, usage = self._request(messages, min(self.timeout, remaining))
            except Exception as exc:  # noqa: BLE001 - every failure becomes a counted None, never a crash
                try:
                    counter, retry_after = self._classify(exc)
                except _NonRetryable as fatal:
                    self.counters.add("client_errors")
                    last_error = f"{type(exc).__name__} ({fatal})"
                    if getattr(exc, "status_code", None) in (401, 403):
                        self.counters.add("auth_errors")
                        self._auth_error = self._auth_message(exc.status_code)
                    break
                self.counters.add(counter)
                last_error = f"{type(exc).__name__}: {self._redact(str(exc))[:200]}"
                if attempt == self.max_retries:
                    break
                delay = self._backoff(attempt, retry_after)
                if time.monotonic() + delay >= deadline:
                    break
                self.counters.add("retries")
                if self._stop.wait(delay):
                    break
                continue
            self._remember(key, answer, usage)
            return answer
        logger.warning("Critic request failed after %d attempt(s): %s", attempts, last_error)
        return None

    def _auth_message(self, status: int) -> str:
        """Why the run must stop after a 401/403: names the key's source and the server, never the key."""
        source = f"the environment variable {self.api_key_env}" if self._key_from_env else "the api_key argument"
        url = _without_userinfo(self.base_url) or "https://api.openai.com/v1 (OpenAI's default)"
        what = "rejected the API key" if status == 401 else "refused the API key access to this model"
        return (
            f"The critic server at {url} {what} (HTTP {status}). The key is read from {source}: check that it is "
            f"set to a valid key for that server (and critic_model={self.model!r}); critic_api_key_env names the "
            "variable."
        )

    def _guarded_ask(self, prompt: str, deadline: float) -> str | None:
        try:
            return self._ask(prompt, deadline)
        except Exception as exc:  # noqa: BLE001 - a bug in one request must not take the batch down
            logger.warning("Critic request crashed: %s", self._redact(f"{type(exc).__name__}: {exc}")[:200])
            return None

    def submit(self, prompts: Sequence[str], texts: Sequence[str] | None = None) -> CriticJob:
        """Start the requests and return at once.

        A prompt identical to one already in flight (the same completion sampled twice in a group, or a batch that
        was prefetched) joins that request instead of paying for a second one (counted as ``deduplicated``).
        """
        self._get_client()
        self._stop.clear()
        deadline = time.monotonic() + self.batch_seconds(len(prompts))
        self.counters.add("requests", len(prompts))
        futures = []
        with self._inflight_lock:
            for prompt in prompts:
                key = DiskCache.key(self.model, prompt, self.params)
                fut = self._inflight.get(key)
                if fut is not None and not fut.done():
                    self.counters.add("deduplicated")
                else:
                    fut = self._pool.submit(self._guarded_ask, prompt, deadline)
                    self._inflight[key] = fut
                    fut.add_done_callback(lambda f, k=key: self._forget(k, f))
                futures.append(fut)
        return CriticJob(futures=futures, counters=self.counters, deadline=deadline + 1.0)

    def batch_seconds(self, n: int) -> float:
        """How long a batch of `n` prompts may take before its unanswered requests count as failed."""
        if self.batch_timeout is not None:
            return self.batch_timeout
        longest_wait = max(self.backoff_max, self.retry_after_max)  # a Retry-After can ask for up to retry_after_max
        one = self.timeout * (self.max_retries + 1) + longest_wait * self.max_retries + 5.0
        waves = -(-n // self.workers) - 1  # requests beyond `workers` queue behind the pool
        spacing = n / self.rate_limit if self.rate_limit else 0.0
        return one + max(waves, 0) * self.timeout + spacing

    def _forget(self, key: str, fut: cf.Future) -> None:
        with self._inflight_lock:  # re-entrant: the callback runs inline when the future is already done
            if self._inflight.get(key) is fut:
                del self._inflight[key]

    def generate(self, prompts: Sequence[str], texts: Sequence[str] | None = None) -> list[str | None]:
        return self.submit(prompts, texts).result()

    def close(self) -> None:
        self._stop.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001
                pass
            self._client = None


# --------------------------------------------------------------------------------------------------------------------
# Local transformers backend


class TransformersCritic(CriticBackend):
    """A local causal LM as the critic (self-critique with the policy itself, or any local model), batched.

    Greedy decoding, left padding, prompts truncated from the left (the text under critique sits at the end of the
    prompt) to fit the model's context. A batch that raises gives None for its prompts.

    Args:
        model: A `PreTrainedModel` or a path/name for ``AutoModelForCausalLM.from_pretrained``.
        tokenizer: Its tokenizer (loaded from `model` when it is a path).
        batch_size: Prompts per `generate` call.
        max_new_tokens: Answer length limit.
        use_chat_template: Wrap each prompt as a user turn; None: when the tokenizer has a chat template.
        max_prompt_length: Prompt tokens kept; default: the model's context minus `max_new_tokens`.
    """

    name = "transformers"

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        batch_size: int = 8,
        max_new_tokens: int = 64,
        use_chat_template: bool | None = None,
        max_prompt_length: int | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        if isinstance(model, (str, os.PathLike)):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model)
            model = AutoModelForCausalLM.from_pretrained(model)
        if tokenizer is None:
            raise ValueError("TransformersCritic needs the model's tokenizer (tokenizer=...).")
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_new_tokens = max_new_tokens
        self.use_chat_template = (
            bool(getattr(tokenizer, "chat_template", None)) if use_chat_template is None else use_chat_template
        )
        if max_prompt_length is None:
            context = getattr(getattr(model, "config", None), "max_position_embeddings", None) or getattr(
                getattr(model, "config", None), "n_positions", None
            )
            max_prompt_length = (context - max_new_tokens) if context else 2048
        if max_prompt_length < 1:
            raise ValueError("max_prompt_length must leave room for the prompt; lower max_new_tokens.")
        self.max_prompt_length = max_prompt_length

    def __repr__(self) -> str:
        return f"TransformersCritic(model={type(self.model).__name__}, batch_size={self.batch_size})"

    def _encode(self, prompt: str) -> list[int]:
        if self.use_chat_template:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        return list(ids)[-self.max_prompt_length :]

    def _generate_batch(self, prompts: Sequence[str]) -> list[str]:
        import torch

        encoded = [self._encode(p) for p in prompts]
        width = max(len(e) for e in encoded)
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = self.tokenizer.eos_token_id
        input_ids = torch.tensor([[pad_id] * (width - len(e)) + e for e in encoded])
        attention_mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                out = self.model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    max_new_tokens=self.max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad_id,
                )
        finally:
            self.model.train(was_training)
        new_tokens = out[:, width:].tolist()
        return self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)

    def generate(self, prompts: Sequence[str], texts: Sequence[str] | None = None) -> list[str | None]:
        answers: list[str | None] = []
        self.counters.add("requests", len(prompts))
        for start in range(0, len(prompts), self.batch_size):
            batch = list(prompts[start : start + self.batch_size])
            self.counters.add("attempts")
            try:
                got = self._generate_batch(batch)
                self.counters.add("successes", len(batch))
                answers.extend(got)
            except Exception as exc:  # noqa: BLE001 - a failed batch gives zero intrinsic reward, not a crash
                logger.warning("Local critic batch failed: %s: %s", type(exc).__name__, str(exc)[:200])
                self.counters.add("failures", len(batch))
                answers.extend([None] * len(batch))
        return answers


# --------------------------------------------------------------------------------------------------------------------
# Offline lexicon backend

_WORD_RE = re.compile(r"[A-Za-z][A-Za-z'\u2019]*[A-Za-z]|[A-Za-z]")


def format_sentiment_answer(positive: Sequence[str], negative: Sequence[str]) -> str:
    """The sentiment answer format of the prompts (and of RELC's critic)."""

    def block(spans: Sequence[str]) -> str:
        if not spans:
            return "None identified"
        return "\n".join(f"[Span {i}]: {s}" for i, s in enumerate(spans, 1))

    return f"Identified Positive Text Span:\n{block(positive)}\nIdentified Negative Text Span:\n{block(negative)}"


def format_toxicity_answer(toxic: Sequence[str]) -> str:
    """The toxicity answer format of the prompts (and of RELC's critic)."""
    if not toxic:
        return "Toxic Span: None identified"
    return "\n".join(f"Toxic Span {i}: {s}" for i, s in enumerate(toxic, 1))


def _merge(text: str, ranges: list[tuple[int, int]]) -> list[str]:
    """Join ranges that overlap or touch through whitespace into phrases; return the phrases' text."""
    merged: list[list[int]] = []
    for a, b in sorted(ranges):
        if merged and (a <= merged[-1][1] or not text[merged[-1][1] : a].strip()):
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out = []
    for a, b in merged:
        phrase = " ".join(text[a:b].split())
        if phrase not in out:
            out.append(phrase)
    return out


SENTIMENT_LEXICONS = ("vader", "afinn")
# Negators of the AFINN critic: its own short list, so that it shares no word list with VADER (the embedded
# environment reward); "n't" endings are caught separately.
_AFINN_NEGATE = frozenset(
    "not no never none nobody nothing neither nor nowhere without cannot hardly barely scarcely".split()
)


def afinn_lexicon() -> dict[str, float]:
    """The single-word entries of AFINN-165 (Nielsen 2011; integer valences -5..5), from the `afinn` package's data
    (``pip install afinn``). Its 30 multi-word entries ("does not work") are left out: spans are found word by word."""
    from importlib import resources

    try:
        data = resources.files("afinn") / "data" / "AFINN-en-165.txt"
    except ModuleNotFoundError as err:
        raise ImportError(
            "The AFINN lexicon critic needs the afinn package: pip install afinn (or trl_stable[rewards])."
        ) from err
    lexicon = {}
    for line in data.read_text(encoding="utf-8").splitlines():
        word, _, value = line.rpartition("\t")
        if word and " " not in word:
            lexicon[word.lower()] = float(value)
    return lexicon


class LexiconCritic(CriticBackend):
    """Offline critic that answers in the LLM answer format from a lexicon (no network, no model).

    - ``task="sentiment"``: every word whose valence in `lexicon` is at least `min_valence` in absolute value is a
      span; a negator among the three preceding words ("not", "never", "isn't", ...) flips it and joins the span
      ("not good" is negative), and a preceding booster ("very") joins it. Neighbouring spans of one polarity merge.
      ``lexicon="vader"``: VADER's word list (valences -4..4), negators and boosters. ``lexicon="afinn"``: AFINN-165
      (valences -5..5; `min_valence` 1 takes every entry), a short negator list of its own and no boosters, so that
      it shares no list with VADER: the critic to pair with a VADER environment reward.
    - ``task="toxicity"``: every word that alt-profanity-check scores at least `toxicity_threshold` is a toxic span
      (neighbours merge).

    It annotates the raw texts passed as ``texts`` (it cannot read a few-shot prompt); without them, the prompts.
    """

    name = "lexicon"

    def __init__(
        self,
        task: str = "sentiment",
        min_valence: float = 1.0,
        toxicity_threshold: float = 0.5,
        lexicon: str = "vader",
    ) -> None:
        super().__init__()
        if task not in ("sentiment", "toxicity"):
            raise ValueError(f"LexiconCritic task must be 'sentiment' or 'toxicity', got {task!r}.")
        if lexicon not in SENTIMENT_LEXICONS:
            raise ValueError(f"LexiconCritic lexicon must be one of {SENTIMENT_LEXICONS}, got {lexicon!r}.")
        self.task = task
        self.lexicon = lexicon
        self.min_valence = min_valence
        self.toxicity_threshold = toxicity_threshold
        if task == "sentiment" and lexicon == "afinn":
            self._lexicon = afinn_lexicon()
            self._negate = set(_AFINN_NEGATE)
            self._boost: set[str] = set()
        elif task == "sentiment":
            from vaderSentiment import vaderSentiment as vader

            self._lexicon = vader.SentimentIntensityAnalyzer().lexicon
            self._negate = {w.lower() for w in vader.NEGATE}
            self._boost = {w.lower() for w in vader.BOOSTER_DICT}
        else:
            from profanity_check import predict_prob

            self._predict_prob = predict_prob

    def __repr__(self) -> str:
        if self.task == "sentiment":
            return f"LexiconCritic(task={self.task!r}, lexicon={self.lexicon!r})"
        return f"LexiconCritic(task={self.task!r})"

    def scored_spans(self, text: str) -> list[tuple[int, int, float]]:
        """(start, end, valence) of each sentiment word of `text` (sentiment task): the character range includes a
        negator that flipped the valence and a booster before the word."""
        if self.task != "sentiment":
            raise ValueError("scored_spans needs a sentiment LexiconCritic.")
        words = [(m.group(0), m.start(), m.end()) for m in _WORD_RE.finditer(text)]
        spans: list[tuple[int, int, float]] = []
        for i, (word, start, end) in enumerate(words):
            valence = self._lexicon.get(word.lower().replace("\u2019", "'"))
            if valence is None or abs(valence) < self.min_valence:
                continue
            lo = start
            if i > 0 and words[i - 1][0].lower() in self._boost:
                lo = words[i - 1][1]
            for j in range(i - 1, max(-1, i - 4), -1):
                # A negator reaches over at most two words of its own clause and no other sentiment word.
                if re.search(r"[,.;:!?]", text[words[j][2] : start]):
                    break
                w = words[j][0].lower().replace("\u2019", "'")
                if w in self._negate or w.endswith("n't"):
                    valence, lo = -valence, min(lo, words[j][1])
                    break
                if abs(self._lexicon.get(w, 0.0)) >= self.min_valence:
                    break
            spans.append((lo, end, float(valence)))
        return spans

    def _sentiment(self, text: str) -> str:
        spans = self.scored_spans(text)
        pos = [(lo, end) for lo, end, valence in spans if valence > 0]
        neg = [(lo, end) for lo, end, valence in spans if valence < 0]
        return format_sentiment_answer(_merge(text, pos), _merge(text, neg))

    def _toxicity(self, texts: Sequence[str]) -> list[str]:
        per_text = [[(m.group(0), m.start(), m.end()) for m in _WORD_RE.finditer(t)] for t in texts]
        flat = [w for words in per_text for (w, _, _) in words]
        probs = list(self._predict_prob(flat)) if flat else []
        answers, k = [], 0
        for text, words in zip(texts, per_text):
            ranges = []
            for _, start, end in words:
                if probs[k] >= self.toxicity_threshold:
                    ranges.append((start, end))
                k += 1
            answers.append(format_toxicity_answer(_merge(text, ranges)))
        return answers

    def generate(self, prompts: Sequence[str], texts: Sequence[str] | None = None) -> list[str | None]:
        texts = list(texts) if texts is not None else list(prompts)
        self.counters.add("requests", len(texts))
        self.counters.add("attempts")
        answers = [self._sentiment(t) for t in texts] if self.task == "sentiment" else self._toxicity(texts)
        self.counters.add("successes", len(texts))
        return list(answers)
