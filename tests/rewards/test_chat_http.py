"""The standard-library chat-completions client against a real HTTP server on 127.0.0.1: keep-alive, reconnects,
typed errors, proxies from the environment, and a key that never appears in an error."""

import socket

import pytest

from trl_stable.rewards.critic.transport import (
    ChatBadResponse,
    ChatConnectionError,
    ChatHTTPClient,
    ChatStatusError,
    ChatTimeout,
)

try:
    from fake_openai_server import FakeOpenAIServer, drop, hang, malformed, reply, status
except ImportError:  # tests/rewards became a package
    from tests.rewards.fake_openai_server import FakeOpenAIServer, drop, hang, malformed, reply, status

KEY = "sk-chat-http-secret-91c"
PAYLOAD = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "temperature": 0.0, "max_tokens": 8}


@pytest.fixture
def server():
    with FakeOpenAIServer(answer=lambda prompt: f"echo {prompt}") as srv:
        yield srv


@pytest.fixture(autouse=True)
def no_proxies(monkeypatch):
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def test_answer_usage_body_and_bearer_key(server):
    client = ChatHTTPClient(server.base_url, KEY)
    answer, usage = client.create(PAYLOAD, timeout=5)
    assert answer == "echo hello"
    assert usage == {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
    (got,) = server.received
    assert got.body == PAYLOAD
    assert got.headers["Authorization"] == f"Bearer {KEY}"
    client.close()


def test_one_keep_alive_connection_per_thread(server):
    client = ChatHTTPClient(server.base_url, KEY)
    for _ in range(3):
        client.create(PAYLOAD, timeout=5)
    assert len(client._open) == 1  # three requests, one connection
    client.close()
    assert not client._open


def test_dropped_connection_is_an_error_and_the_next_request_reconnects(server):
    client = ChatHTTPClient(server.base_url, KEY)
    client.create(PAYLOAD, timeout=5)
    server.script(drop())
    with pytest.raises(ChatConnectionError):
        client.create(PAYLOAD, timeout=5)
    assert client.create(PAYLOAD, timeout=5)[0] == "echo hello"
    client.close()


def test_typed_errors_with_headers_and_no_key_in_messages(server):
    client = ChatHTTPClient(server.base_url, KEY)
    server.script(status(429, retry_after=7), malformed(), reply(None), hang(2.0))
    with pytest.raises(ChatStatusError) as err:
        client.create(PAYLOAD, timeout=5)
    assert err.value.status_code == 429 and err.value.headers.get("retry-after") == "7"
    with pytest.raises(ChatBadResponse):
        client.create(PAYLOAD, timeout=5)
    with pytest.raises(ChatBadResponse, match="without text"):
        client.create(PAYLOAD, timeout=5)
    with pytest.raises(ChatTimeout):
        client.create(PAYLOAD, timeout=0.3)
    assert client.create(PAYLOAD, timeout=5)[0] == "echo hello"  # reconnected after the timeout
    assert KEY not in str(err.value) and KEY not in repr(err.value)
    client.close()


def test_http_proxy_from_the_environment_is_used(server, monkeypatch):
    # The loopback server plays the proxy: a request for an unresolvable host arrives there with its absolute URL.
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{server.port}")
    monkeypatch.setenv("NO_PROXY", "")
    client = ChatHTTPClient("http://critic.invalid:9/v1", KEY)
    assert client.create(PAYLOAD, timeout=5)[0] == "echo hello"
    assert len(server.received) == 1
    client.close()


def test_no_proxy_bypasses_the_proxy(server, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{dead}")  # nothing listens there
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    client = ChatHTTPClient(server.base_url, KEY)
    assert client.create(PAYLOAD, timeout=5)[0] == "echo hello"
    client.close()


def test_unreachable_server_is_a_connection_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = ChatHTTPClient(f"http://127.0.0.1:{port}/v1", KEY)
    with pytest.raises(ChatConnectionError):
        client.create(PAYLOAD, timeout=2)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/v1", "127.0.0.1:8000/v1", "http:///v1"])
def test_bad_base_url_is_refused(url):
    with pytest.raises(ValueError, match="base_url"):
        ChatHTTPClient(url, KEY)
