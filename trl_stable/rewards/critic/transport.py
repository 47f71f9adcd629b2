"""The critic's transports, httpx (``transport="http"``, one keep-alive connection per worker thread: measured
faster than httpx's AsyncClient) and the OpenAI SDK: one chat-completions request in, (answer text, token usage) out,
or one of four typed errors that both raise alike."""

from __future__ import annotations

import email.utils
import json
import math
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from datetime import timezone
from typing import Any

import httpcore2
import httpx2

TRANSPORTS = ("http", "openai")  # our httpx client, the OpenAI SDK


def check_transport(name: str, value: str) -> None:
    if value not in TRANSPORTS:
        raise ValueError(f"{name} must be 'http' (our client) or 'openai' (the SDK), got {value!r}.")


class ChatError(Exception):
    """Base of the clients' errors."""


class ChatTimeout(ChatError):
    """The request did not complete within its timeout."""


class ChatConnectionError(ChatError):
    """The connection could not be opened or broke before a response."""


class ChatBadResponse(ChatError):
    """A 2xx response whose body is not a chat completion with text."""


class ChatStatusError(ChatError):
    """A non-2xx response."""

    def __init__(self, status_code: int, headers: Any, body: str) -> None:
        super().__init__(f"HTTP {status_code}: {body[:200]}")
        self.status_code = status_code
        self.headers = headers  # case-insensitive `get`


def _nothing() -> None:
    pass


# httpcore's errors but timeouts; their classes share no base
_CONNECTION_ERRORS = (
    httpcore2.NetworkError,
    httpcore2.ProtocolError,
    httpcore2.ProxyError,
    httpcore2.UnsupportedProtocol,
    httpcore2.ConnectionNotAvailable,
)
_RETRYABLE = {ChatTimeout: "timeouts", ChatConnectionError: "connection_errors", ChatBadResponse: "bad_responses"}


def classify(exc: BaseException) -> tuple[str, float | None] | None:
    """(counter name, Retry-After seconds) of a transport error a retry can fix; None for the others."""
    if not isinstance(exc, ChatStatusError):
        return (_RETRYABLE[type(exc)], None) if type(exc) in _RETRYABLE else None
    status = exc.status_code
    counter = "rate_limited" if status == 429 else "server_errors" if status >= 500 or status in (408, 409) else None
    # A 503 may carry Retry-After too (RFC 9110), so every retryable status's headers are read.
    return None if counter is None else (counter, parse_retry_after(exc.headers))


def _answer_and_usage(data: Any) -> tuple[str, dict | None]:
    try:
        answer = data["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as exc:
        raise ChatBadResponse(f"not a chat completion: {type(exc).__name__}") from exc
    if not isinstance(answer, str):
        raise ChatBadResponse("answer without text content")
    usage = data.get("usage")
    return answer, usage if isinstance(usage, dict) else None


class HTTPXChatClient:
    """POSTs chat-completions requests to `base_url` (e.g. ``http://127.0.0.1:8000/v1``) + ``/chat/completions``
    with `api_key` as the bearer token (never part of a message); safe to call from many threads.

    Each worker thread has its own pool of one keep-alive connection, built by `httpx.HTTPTransport` (so the proxy,
    ``*_PROXY`` / ``NO_PROXY``, and the trust store, ``SSL_CERT_FILE``, read once from the environment for the one
    host, are handled as httpx handles them), and sends through httpcore's `request` on it: httpx's request and
    response models cost about a fifth of a request's CPU (measured) and a critic needs none of their features.
    """

    def __init__(self, base_url: str, api_key: str) -> None:
        parts = urllib.parse.urlsplit(base_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"critic base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {parts.scheme!r}."
            )
        # credentials in the URL are not sent (the key is the bearer token) and never appear in a message
        host = parts.netloc.rsplit("@", 1)[-1]
        self._url = urllib.parse.urlunsplit((parts.scheme, host, parts.path + "/chat/completions", "", "")).encode()
        auth = {"Authorization": f"Bearer {api_key}", "User-Agent": "trl_stable-critic"}
        self._headers = httpx2.Headers({"Content-Type": "application/json", "Accept": "application/json", **auth}).raw
        self._ssl = httpx2.create_ssl_context()  # one trust store for every connection (building one takes ~50 ms)
        proxies = urllib.request.getproxies_environment()
        bypass = urllib.request.proxy_bypass_environment(parts.hostname, proxies)
        self._proxy = None if bypass else proxies.get(parts.scheme) or proxies.get("all")
        self._local = threading.local()
        self._open: list[httpx2.HTTPTransport] = []
        self._open_lock = threading.Lock()

    def _pool(self) -> Any:
        pool = getattr(self._local, "pool", None)
        if pool is None:
            one = httpx2.Limits(max_connections=1, max_keepalive_connections=1)
            transport = httpx2.HTTPTransport(verify=self._ssl, proxy=self._proxy, limits=one)
            pool = self._local.pool = transport._pool  # integration.trl_members: HTTPTransport._pool
            with self._open_lock:
                self._open.append(transport)
        return pool

    def create(
        self, payload: dict[str, Any], timeout: float, on_sent: Callable[[], None] = _nothing
    ) -> tuple[str, dict | None]:
        """One chat completion: (the answer's text, the ``usage`` dict or None); raises a `ChatError`. `on_sent` is
        called once the request body is written."""

        def trace(event: str, info: dict) -> None:  # httpcore's request tracing (httpx's "trace" extension)
            if event == "http11.send_request_body.complete":
                on_sent()

        extensions = {"timeout": dict.fromkeys(("connect", "read", "write", "pool"), timeout), "trace": trace}
        body = json.dumps(payload).encode()
        try:
            response = self._pool().request(
                "POST", self._url, headers=self._headers, content=body, extensions=extensions
            )
        except httpcore2.TimeoutException as exc:
            raise ChatTimeout(f"no response within {timeout:g} s") from exc
        except _CONNECTION_ERRORS as exc:
            # includes a keep-alive connection the server closed while idle: the caller's retry reconnects
            raise ChatConnectionError(type(exc).__name__) from exc
        if not 200 <= response.status < 300:
            text = response.content.decode(errors="replace")
            raise ChatStatusError(response.status, httpx2.Headers(response.headers), text)
        try:
            data = json.loads(response.content)
        except ValueError as exc:
            raise ChatBadResponse(f"not a chat completion: {type(exc).__name__}") from exc
        return _answer_and_usage(data)

    def close(self) -> None:
        with self._open_lock:
            transports, self._open = self._open, []
        for transport in transports:
            transport.close()


class SDKChatClient:
    """The same `create` through the OpenAI SDK (its own retries off: ours are counted, jittered, deadline-aware);
    the SDK's errors become the typed errors above."""

    def __init__(self, base_url: str | None, api_key: str, timeout: float) -> None:
        import openai

        self._openai = openai
        self._client = openai.OpenAI(api_key=api_key, base_url=base_url, timeout=timeout, max_retries=0)

    def create(
        self, payload: dict[str, Any], timeout: float, on_sent: Callable[[], None] = _nothing
    ) -> tuple[str, dict | None]:
        openai = self._openai
        on_sent()  # the SDK does not say when its request is written: at least its caller has handed it over
        try:
            resp = self._client.chat.completions.create(**payload, timeout=timeout)
        except openai.APITimeoutError as exc:
            raise ChatTimeout(f"no response within {timeout:g} s") from exc
        except openai.APIConnectionError as exc:
            raise ChatConnectionError(type(exc).__name__) from exc
        except openai.APIStatusError as exc:
            raise ChatStatusError(exc.status_code, exc.response.headers, str(exc.message)) from exc
        except (openai.APIResponseValidationError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise ChatBadResponse(f"not a chat completion: {type(exc).__name__}") from exc  # a body that is none
        return _answer_and_usage(resp.model_dump(warnings=False) if hasattr(resp, "model_dump") else resp)

    def close(self) -> None:
        self._client.close()


def _seconds(raw: Any, scale: float = 1.0) -> float | None:
    try:
        value = float(raw) / scale
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and value >= 0 else None


def parse_retry_after(headers: Any, now: float | None = None) -> float | None:
    """Seconds a server asked the client to wait (None: it did not say), from ``retry-after-ms`` (OpenAI's, Azure's)
    or ``Retry-After`` as delta-seconds or an HTTP-date (RFC 9110 10.2.3; past: 0, `now` default ``time.time()``).

    Example:
        >>> parse_retry_after({"retry-after-ms": "1500"}), parse_retry_after({"Retry-After": "20"})
        (1.5, 20.0)
    """
    if headers is None:
        return None
    lower = {str(k).lower(): v for k, v in headers.items()}
    ms = _seconds(lower.get("retry-after-ms"), 1000.0)
    if ms is not None:
        return ms
    raw = str(lower.get("retry-after", "")).strip()
    seconds = _seconds(raw)
    if seconds is not None or not raw:
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError):  # Python >= 3.10 raises for what it cannot read
        return None
    if when.tzinfo is None:  # HTTP-dates are GMT
        when = when.replace(tzinfo=timezone.utc)
    now = time.time() if now is None else now
    return max(0.0, when.timestamp() - now)
