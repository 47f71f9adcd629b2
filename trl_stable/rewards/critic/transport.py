"""The critic's transports: one chat-completions request in, (answer text, token usage) out, or a typed error.

Two clients give the same errors, so the caller counts and retries them one way: `ChatStatusError` (with the
response headers, for Retry-After), `ChatTimeout`, `ChatConnectionError`, `ChatBadResponse`.

- `ChatHTTPClient`: a lean standard-library client: one keep-alive HTTP/1.1 connection per worker thread
  (reopened after an error), HTTPS with the system trust store (``SSL_CERT_FILE`` honoured), the proxies of the
  environment (``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``NO_PROXY``, HTTPS tunnelled with CONNECT), a per-request
  timeout.
- `SDKChatClient`: the OpenAI SDK, for setups that need what it adds.

`parse_retry_after` reads how long a server asked the client to wait.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import math
import ssl
import threading
import time
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from typing import Any

TRANSPORTS = ("http", "openai")  # our client, the OpenAI SDK


class ChatError(Exception):
    """Base of the client's errors."""


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
        self.headers = headers  # case-insensitive `get`, like httpx's headers


class ChatHTTPClient:
    """POSTs chat-completions requests to `base_url` + ``/chat/completions``; safe to call from many threads.

    Args:
        base_url: The API root, e.g. ``http://127.0.0.1:8000/v1`` (vLLM) or ``https://api.openai.com/v1``.
        api_key: Sent as a bearer token; never part of an error message.
    """

    def __init__(self, base_url: str, api_key: str) -> None:
        parts = urllib.parse.urlsplit(base_url.rstrip("/"))
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"critic base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {parts.scheme!r}."
            )
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = parts.port or (443 if self._https else 80)
        self._path = (parts.path or "") + "/chat/completions"
        self._url = urllib.parse.urlunsplit((parts.scheme, parts.netloc.rsplit("@", 1)[-1], self._path, "", ""))
        self._headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "Authorization": f"Bearer {api_key}",
            "User-Agent": "trl_stable-critic",
        }
        proxy = None if urllib.request.proxy_bypass(self._host) else urllib.request.getproxies().get(parts.scheme)
        self._proxy = urllib.parse.urlsplit(proxy) if proxy else None
        self._ssl = ssl.create_default_context() if self._https else None
        self._local = threading.local()
        self._open: set[http.client.HTTPConnection] = set()
        self._open_lock = threading.Lock()

    def _connect(self) -> http.client.HTTPConnection:
        if self._proxy is None:
            if self._https:
                return http.client.HTTPSConnection(self._host, self._port, context=self._ssl)
            return http.client.HTTPConnection(self._host, self._port)
        proxy_port = self._proxy.port or (443 if self._proxy.scheme == "https" else 80)
        if self._https:  # CONNECT tunnel through the proxy, TLS to the server inside it
            conn = http.client.HTTPSConnection(self._proxy.hostname, proxy_port, context=self._ssl)
            conn.set_tunnel(self._host, self._port)
            return conn
        return http.client.HTTPConnection(self._proxy.hostname, proxy_port)

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
            with self._open_lock:
                self._open.add(conn)
        return conn

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            with self._open_lock:
                self._open.discard(conn)
            conn.close()

    def create(self, payload: dict[str, Any], timeout: float) -> tuple[str, dict | None]:
        """One chat completion: (the answer's text, the ``usage`` dict or None); raises a `ChatError`."""
        body = json.dumps(payload).encode()
        target = self._url if (self._proxy is not None and not self._https) else self._path
        conn = self._connection()
        conn.timeout = timeout
        if conn.sock is not None:
            conn.sock.settimeout(timeout)
        try:
            conn.request("POST", target, body=body, headers=self._headers)
            response = conn.getresponse()
            raw = response.read()
        except TimeoutError as exc:
            self._drop_connection()
            raise ChatTimeout(f"no response within {timeout:g} s") from exc
        except (OSError, http.client.HTTPException) as exc:
            # Includes a keep-alive connection the server closed while idle: the caller's retry reconnects.
            self._drop_connection()
            raise ChatConnectionError(f"{type(exc).__name__}: {exc}") from exc
        if response.will_close:
            self._drop_connection()
        text = raw.decode("utf-8", errors="replace")
        if not 200 <= response.status < 300:
            raise ChatStatusError(response.status, response.headers, text)
        try:
            data = json.loads(text)
            answer = data["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ChatBadResponse(f"not a chat completion: {type(exc).__name__}") from exc
        if not isinstance(answer, str):
            raise ChatBadResponse("answer without text content")
        usage = data.get("usage")
        return answer, usage if isinstance(usage, dict) else None

    def close(self) -> None:
        """Close every open connection."""
        with self._open_lock:
            conns, self._open = list(self._open), set()
        for conn in conns:
            conn.close()


class SDKChatClient:
    """The same `create` through the OpenAI SDK (its own retries off: ours are counted, jittered, deadline-aware);
    the SDK's errors become the typed errors above."""

    def __init__(self, base_url: str | None, api_key: str, timeout: float) -> None:
        import openai

        self._openai = openai
        self._client = openai.OpenAI(api_key=api_key, base_url=base_url, timeout=timeout, max_retries=0)

    def create(self, payload: dict[str, Any], timeout: float) -> tuple[str, dict | None]:
        openai = self._openai
        try:
            resp = self._client.chat.completions.create(**payload, timeout=timeout)
            answer = resp.choices[0].message.content
        except openai.APITimeoutError as exc:
            raise ChatTimeout(f"no response within {timeout:g} s") from exc
        except openai.APIConnectionError as exc:
            raise ChatConnectionError(type(exc).__name__) from exc
        except openai.APIStatusError as exc:
            raise ChatStatusError(exc.status_code, exc.response.headers, str(exc.message)) from exc
        except (ValueError, KeyError, IndexError, AttributeError, TypeError) as exc:
            raise ChatBadResponse(f"not a chat completion: {type(exc).__name__}") from exc
        if not isinstance(answer, str):
            raise ChatBadResponse("answer without text content")
        usage = getattr(resp, "usage", None)
        return answer, None if usage is None else {
            k: getattr(usage, k, 0) for k in ("prompt_tokens", "completion_tokens")
        }

    def close(self) -> None:
        self._client.close()


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
