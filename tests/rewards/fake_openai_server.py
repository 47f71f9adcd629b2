"""A real HTTP server on 127.0.0.1 that speaks the OpenAI chat-completions protocol, for critic fault tests.

It binds 127.0.0.1 only, on an ephemeral port, with bounded request bodies, socket timeouts and daemon handler
threads, and it never contacts anything. Behaviour is scripted: each request takes the next queued action whose
`match` substring occurs in its prompt (else the default answer):

    with FakeOpenAIServer(answer=lambda prompt: "Toxic Span 1: idiot") as server:
        server.script(status(429, retry_after=0), malformed(), reply("None identified", delay=0.05))
        client = OpenAICritic(base_url=server.base_url, ...)

Actions: `reply` (optionally after a delay), `status` (an error status with an OpenAI error body and optional
headers, e.g. an HTTP-date ``Retry-After`` or ``retry-after-ms``), `malformed` (status 200 with a body that is not
JSON), `drop` (close the connection without answering), `hang` (answer after `seconds`, i.e. after the client's
timeout).

`fault(prompt, k)` (optional) picks an action for the k-th request (0-based) carrying `prompt` when no queued action
applies: a deterministic fault injector for the benchmark. `served` counts the actions taken by kind ("reply",
"status_429", "hang", ...), so a test can check the client's counters against what the server did.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_BODY = 1 << 20
GATE_TIMEOUT = 60.0  # a gated request is released after this long even if the gate never filled (the test fails)


@dataclass
class Action:
    kind: str
    text: str | None = ""  # None: a reply whose message content is null
    code: int = 200
    delay: float = 0.0
    retry_after: float | None = None
    match: str | None = None
    headers: dict | None = None
    label: str | None = None  # the name `served` counts it under (default: its kind)


def reply(text: str | None, delay: float = 0.0, match: str | None = None) -> Action:
    return Action("reply", text=text, delay=delay, match=match)


def status(
    code: int,
    retry_after: float | None = None,
    match: str | None = None,
    message: str = "",
    headers: dict | None = None,
) -> Action:
    return Action("status", code=code, retry_after=retry_after, match=match, text=message, headers=headers)


def malformed(match: str | None = None) -> Action:
    return Action("malformed", match=match)


def drop(match: str | None = None) -> Action:
    return Action("drop", match=match)


def hang(seconds: float, match: str | None = None) -> Action:
    return Action("hang", delay=seconds, match=match)


@dataclass
class Received:
    prompt: str
    body: dict
    headers: dict
    arrival: float


@dataclass
class _State:
    answer: Callable[[str], str]
    latency: float
    fault: Callable[[str, int], Action | None] | None = None
    seen: dict = field(default_factory=dict)  # requests per prompt so far
    served: dict = field(default_factory=dict)  # actions taken, by kind
    lock: threading.Lock = field(default_factory=threading.Lock)
    queue: list[Action] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    gate: int = 0  # requests wait until this many have arrived since the reset (0: no gate)
    arrived: int = 0
    gate_open: threading.Condition = field(default_factory=threading.Condition)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are separate writes; Nagle would add ~40 ms to each reply
    timeout = 10  # an idle keep-alive socket frees its thread after this many seconds
    state: _State  # set on a per-server subclass

    def log_message(self, format, *args):  # noqa: A002 - quiet test output
        pass

    def _send_json(self, code: int, payload: dict, headers: dict | None = None) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802 - http.server naming
        state = self.state
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self._send_json(413, {"error": {"message": "too large", "type": "invalid_request_error"}})
            return
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            prompt = body["messages"][-1]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            self._send_json(400, {"error": {"message": "bad request", "type": "invalid_request_error"}})
            return
        with state.lock:
            state.received.append(Received(prompt, body, dict(self.headers), time.monotonic()))
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            action = None
            for i, queued in enumerate(state.queue):
                if queued.match is None or queued.match in prompt:
                    action = state.queue.pop(i)
                    break
            k = state.seen.get(prompt, 0)
            state.seen[prompt] = k + 1
            if action is None and state.fault is not None:
                action = state.fault(prompt, k)
            kind = "reply" if action is None else action.label or action.kind
            kind = f"status_{action.code}" if kind == "status" else kind
            state.served[kind] = state.served.get(kind, 0) + 1
        try:
            with state.gate_open:
                # Concurrency tests: hold each request (counted in flight) until `gate` have arrived, so "all N were
                # in flight at once" is decided by the client, not by how fast a loaded machine sends them.
                state.arrived += 1
                state.gate_open.notify_all()
                state.gate_open.wait_for(lambda: state.arrived >= state.gate or state.stop.is_set(), GATE_TIMEOUT)
            self._act(action, prompt, body)
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (its timeout): nothing to answer
        finally:
            with state.lock:
                state.in_flight -= 1

    def _act(self, action: Action | None, prompt: str, body: dict) -> None:
        state = self.state
        start = time.monotonic()
        if action is None:
            action = reply(state.answer(prompt))
        if state.latency:  # the latency is the model's time to answer: computing the scripted answer is part of it
            state.stop.wait(max(0.0, state.latency - (time.monotonic() - start)))
        if action.kind in ("reply", "hang"):
            if action.delay:
                state.stop.wait(action.delay)
            text = action.text if action.kind == "reply" else state.answer(prompt)
            self._send_json(
                200,
                {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": body.get("model", "fake"),
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                    ],
                    "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
                },
            )
        elif action.kind == "status":
            headers = {"Retry-After": str(action.retry_after)} if action.retry_after is not None else {}
            headers.update(action.headers or {})
            message = action.text or f"scripted {action.code}"
            self._send_json(action.code, {"error": {"message": message, "type": "x"}}, headers)
        elif action.kind == "malformed":
            payload = b'{"choices": [{"message": {"content": "unterminated'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        elif action.kind == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)


class FakeOpenAIServer:
    """The scripted chat-completions server; use as a context manager (or `start`/`stop`).

    Args:
        answer: Default answer for a prompt (when no scripted action applies).
        latency: Seconds from a request's arrival to its action, the answer's computation included (e.g. 0.1 for
            the benchmark).
    """

    def __init__(
        self,
        answer: Callable[[str], str] | None = None,
        latency: float = 0.0,
        fault: Callable[[str, int], Action | None] | None = None,
    ) -> None:
        self._state = _State(answer=answer or (lambda prompt: "None identified"), latency=latency, fault=fault)
        handler = type("Handler", (_Handler,), {"state": self._state})
        # A batch opens all its connections at once: the default listen backlog of 5 makes the kernel drop the
        # rest, whose clients retry their SYN a second later (a 1 s stall per batch that is no client's fault).
        server_cls = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 512})
        self._server = server_cls(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def received(self) -> list[Received]:
        with self._state.lock:
            return list(self._state.received)

    @property
    def served(self) -> dict:
        with self._state.lock:
            return dict(self._state.served)

    @property
    def max_in_flight(self) -> int:
        return self._state.max_in_flight

    def script(self, *actions: Action) -> None:
        with self._state.lock:
            self._state.queue.extend(actions)

    def hold_until(self, n: int) -> None:
        """From now on (until the next reset) every request waits until `n` requests have arrived."""
        with self._state.gate_open:
            self._state.gate, self._state.arrived = n, 0
            self._state.gate_open.notify_all()

    def hold(self) -> None:
        """Hold every request until `release` (or the gate timeout)."""
        self.hold_until(1 << 30)

    def release(self) -> None:
        """Let held requests (and later ones) through."""
        self.hold_until(0)

    def reset(self) -> None:
        self.hold_until(0)
        with self._state.lock:
            self._state.queue.clear()
            self._state.received.clear()
            self._state.seen.clear()
            self._state.served.clear()
            self._state.max_in_flight = 0

    def start(self) -> FakeOpenAIServer:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._state.stop.set()  # wakes handlers sleeping in a delay
        with self._state.gate_open:  # and those held at the gate
            self._state.gate_open.notify_all()
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
