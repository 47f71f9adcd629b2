"""The httpx chat-completions client against a real HTTP server on 127.0.0.1: keep-alive, reconnects, typed errors,
proxies and TLS from the environment, and a key that never appears in an error."""

import socket
import threading

import pytest

from trl_stable.rewards.critic.transport import (
    ChatBadResponse,
    ChatConnectionError,
    ChatStatusError,
    ChatTimeout,
    HTTPXChatClient,
)

try:
    from fake_openai_server import FakeOpenAIServer, drop, hang, malformed, reply, status
except ImportError:  # tests/rewards became a package
    from tests.rewards.fake_openai_server import FakeOpenAIServer, drop, hang, malformed, reply, status

KEY = "sk-chat-http-secret-91c"
PAYLOAD = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "temperature": 0.0, "max_tokens": 8}


def create(client, timeout=5.0):
    return client.create(PAYLOAD, timeout)


def close(client):
    client.close()


@pytest.fixture
def server():
    with FakeOpenAIServer(answer=lambda prompt: f"echo {prompt}") as srv:
        yield srv


@pytest.fixture(autouse=True)
def no_proxies(monkeypatch):
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def test_answer_usage_body_and_bearer_key(server):
    client = HTTPXChatClient(server.base_url, KEY)
    answer, usage = create(client)
    assert answer == "echo hello"
    assert usage == {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
    (got,) = server.received
    assert got.body == PAYLOAD
    assert got.headers["Authorization"] == f"Bearer {KEY}"
    close(client)


def test_one_keep_alive_connection_per_thread(server):
    client = HTTPXChatClient(server.base_url, KEY)
    for _ in range(3):
        create(client)
    assert len(client._open) == 1  # three requests, one connection
    other = threading.Thread(target=create, args=(client,))
    other.start()
    other.join()
    assert len(client._open) == 2  # another thread, its own connection
    close(client)
    assert not client._open


def test_url_credentials_are_not_sent(server):
    client = HTTPXChatClient(server.base_url.replace("//", "//user:pw-in-url@"), KEY)
    assert create(client)[0] == "echo hello"
    assert server.received[0].headers["Authorization"] == f"Bearer {KEY}"  # the key, not basic auth from the URL
    close(client)


def test_dropped_connection_is_an_error_and_the_next_request_reconnects(server):
    client = HTTPXChatClient(server.base_url, KEY)
    create(client)
    server.script(drop())
    with pytest.raises(ChatConnectionError):
        create(client)
    assert create(client)[0] == "echo hello"
    close(client)


def test_typed_errors_with_headers_and_no_key_in_messages(server):
    client = HTTPXChatClient(server.base_url, KEY)
    server.script(status(429, retry_after=7), malformed(), reply(None), hang(2.0))
    with pytest.raises(ChatStatusError) as err:
        create(client)
    assert err.value.status_code == 429 and err.value.headers.get("retry-after") == "7"
    with pytest.raises(ChatBadResponse):
        create(client)
    with pytest.raises(ChatBadResponse, match="without text"):
        create(client)
    with pytest.raises(ChatTimeout):
        create(client, timeout=0.3)
    assert create(client)[0] == "echo hello"  # reconnected after the timeout
    assert KEY not in str(err.value) and KEY not in repr(err.value)
    close(client)


def test_http_proxy_from_the_environment_is_used(server, monkeypatch):
    # The loopback server plays the proxy: a request for an unresolvable host arrives there with its absolute URL.
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{server.port}")
    monkeypatch.setenv("NO_PROXY", "")
    client = HTTPXChatClient("http://critic.invalid:9/v1", KEY)
    assert create(client)[0] == "echo hello"
    assert len(server.received) == 1
    close(client)


def test_no_proxy_bypasses_the_proxy(server, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{dead}")  # nothing listens there
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    client = HTTPXChatClient(server.base_url, KEY)
    assert create(client)[0] == "echo hello"
    close(client)


def test_tls_trust_store_from_the_environment(monkeypatch, tmp_path):
    # SSL_CERT_FILE names the bundle the one shared TLS context is built from
    import ssl

    seen = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    bundle = tmp_path / "ca.pem"
    bundle.write_text("")
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    with pytest.raises(ssl.SSLError):  # an empty bundle: nothing to trust, and the client says so at once
        HTTPXChatClient("https://127.0.0.1:9/v1", KEY)
    assert seen == [{"cafile": str(bundle)}]


def test_unreachable_server_is_a_connection_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = HTTPXChatClient(f"http://127.0.0.1:{port}/v1", KEY)
    sent = []
    with pytest.raises(ChatConnectionError):
        client.create(PAYLOAD, 2.0, lambda: sent.append(1))
    assert sent == []  # nothing was written


def test_on_sent_is_called_once_the_body_is_written(server):
    client = HTTPXChatClient(server.base_url, KEY)
    sent = []
    assert client.create(PAYLOAD, 5.0, lambda: sent.append(len(server.received)))[0] == "echo hello"
    assert len(sent) == 1
    close(client)


def test_httpx_transport_builds_the_httpcore_pool_we_send_through():
    # integration.trl_members: HTTPTransport._pool, the pool httpx built from our settings (proxy, TLS, limits)
    import inspect

    import httpcore2
    import httpx2

    assert isinstance(httpx2.HTTPTransport()._pool, httpcore2.ConnectionPool)
    assert isinstance(httpx2.HTTPTransport(proxy="http://127.0.0.1:9")._pool, httpcore2.HTTPProxy)
    params = inspect.signature(httpcore2.ConnectionPool.request).parameters
    assert {"method", "url", "headers", "content", "extensions"} <= set(params)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1/v1", "127.0.0.1:8000/v1", "http:///v1"])
def test_bad_base_url_is_refused(url):
    with pytest.raises(ValueError, match="base_url"):
        HTTPXChatClient(url, KEY)
