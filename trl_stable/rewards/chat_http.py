"""A lean chat-completions client on the standard library, for the critic's many small concurrent requests.

Why not the OpenAI SDK: a batch of N critic requests is N threads that each spend a little CPU building the request
and parsing the answer, all under one GIL. The SDK spends about 2 ms of CPU per request (request options, httpx,
pydantic models) against about 0.2 ms here, so 64 requests at 100 ms latency cost about 0.19 s through the SDK and
0.11 s through this client (`benchmarks/bench_critic.py` measures both). The SDK stays available
(``OpenAICritic(transport="openai")``) for setups that need what it adds.

What it does: one keep-alive HTTP/1.1 connection per worker thread (reopened after an error), HTTPS with the system
trust store (``SSL_CERT_FILE`` honoured), the proxies of the environment (``HTTPS_PROXY`` / ``HTTP_PROXY`` /
``NO_PROXY``, HTTPS tunnelled with CONNECT), a per-request timeout. Errors are typed so the caller can count and
retry them: `ChatStatusError` (with the response headers, for Retry-After), `ChatTimeout`, `ChatConnectionError`,
`ChatBadResponse`.
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import urllib.parse
import urllib.request
from typing import Any


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

    def __init__(self, status_code: int, headers: http.client.HTTPMessage, body: str) -> None:
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
