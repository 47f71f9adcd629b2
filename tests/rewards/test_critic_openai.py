"""OpenAICritic against a real HTTP server on 127.0.0.1: retries, timeouts, concurrency, cache, rate limit, counters,
and that the API key never leaks."""

import json
import logging
import os
import pickle
import socket
import time
from email.utils import formatdate

import pytest

from trl_stable.rewards import OpenAICritic

try:
    from fake_openai_server import FakeOpenAIServer, drop, hang, malformed, reply, status
except ImportError:  # tests/rewards became a package
    from tests.rewards.fake_openai_server import FakeOpenAIServer, drop, hang, malformed, reply, status

DUMMY_KEY = "sk-test-DUMMY-do-not-leak-4f2a"


@pytest.fixture
def server():
    with FakeOpenAIServer(answer=lambda prompt: f"Toxic Span 1: {prompt.split()[-1]}") as srv:
        yield srv


@pytest.fixture(autouse=True)
def dummy_key(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", DUMMY_KEY)


@pytest.fixture(autouse=True, params=["http", "openai"])
def transport(request, monkeypatch):
    """Every test runs through both HTTP clients: the standard-library one (default) and the OpenAI SDK."""
    original = OpenAICritic.__init__

    def init(self, *args, **kw):
        kw.setdefault("transport", request.param)
        original(self, *args, **kw)

    monkeypatch.setattr(OpenAICritic, "__init__", init)
    return request.param


def make(server, **kw):
    defaults = dict(
        model="critic-test", base_url=server.base_url, timeout=2.0, max_retries=2, backoff_base=0.01,
        backoff_max=0.05, concurrency=4, seed=0,
    )  # fmt: skip
    defaults.update(kw)
    return OpenAICritic(**defaults)


def test_answers_in_order_with_counters_and_key_sent(server):
    critic = make(server)
    prompts = [f"text number {i}" for i in range(10)]
    assert critic.generate(prompts) == [f"Toxic Span 1: {i}" for i in range(10)]
    m = critic.metrics()
    assert m["critic/requests"] == 10 and m["critic/successes"] == 10 and m["critic/attempts"] == 10
    assert m["critic/failures"] == 0 and m["critic/retries"] == 0
    assert m["critic/prompt_tokens"] == 10 * 11 and m["critic/completion_tokens"] == 10 * 7
    got = server.received[0]
    assert got.body["model"] == "critic-test" and got.body["temperature"] == 0.0 and got.body["max_tokens"] == 128
    assert {k.lower(): v for k, v in got.headers.items()}["authorization"] == f"Bearer {DUMMY_KEY}"
    critic.close()


@pytest.mark.parametrize(
    "fault, counter",
    [
        (status(429, retry_after=0), "critic/rate_limited"),
        (status(500), "critic/server_errors"),
        (status(503), "critic/server_errors"),
        (malformed(), "critic/bad_responses"),
        (drop(), "critic/connection_errors"),
        (reply(None), "critic/bad_responses"),  # a 200 whose message has no text (content null)
    ],
)
def test_transient_fault_is_retried(server, fault, counter):
    critic = make(server)
    server.script(fault)
    assert critic.generate(["hello world"]) == ["Toxic Span 1: world"]
    m = critic.metrics()
    assert m[counter] == 1 and m["critic/retries"] == 1 and m["critic/attempts"] == 2
    assert m["critic/failures"] == 0 and m["critic/successes"] == 1
    assert len(server.received) == 2
    critic.close()


def test_retry_after_is_honoured(server):
    critic = make(server, backoff_max=1.0)
    server.script(status(429, retry_after=0.3))
    assert critic.generate(["a b"]) == ["Toxic Span 1: b"]
    first, second = server.received
    assert second.arrival - first.arrival >= 0.29  # waited at least the server's Retry-After


def test_exponential_backoff_between_attempts(server):
    critic = make(server, max_retries=3, backoff_base=0.1, backoff_max=10.0)
    server.script(status(500), status(500), status(500))
    assert critic.generate(["x y"]) == ["Toxic Span 1: y"]
    t = [r.arrival for r in server.received]
    gaps = [b - a for a, b in zip(t, t[1:])]
    # delay_k = 0.1 * 2**k * U(0.5, 1): at least 0.05, 0.1, 0.2 seconds
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1 and gaps[2] >= 0.2


@pytest.mark.parametrize("code", [400, 401, 403, 404])
def test_client_errors_are_not_retried(server, code):
    critic = make(server)
    server.script(status(code))
    assert critic.generate(["x"]) == [None]
    m = critic.metrics()
    assert m["critic/client_errors"] == 1 and m["critic/attempts"] == 1 and m["critic/failures"] == 1
    assert m["critic/retries"] == 0


def test_persistent_failure_exhausts_retries_then_none(server):
    critic = make(server, max_retries=3)
    server.script(*[status(500)] * 4)
    assert critic.generate(["x"]) == [None]
    m = critic.metrics()
    assert m["critic/attempts"] == 4 and m["critic/retries"] == 3 and m["critic/failures"] == 1


def test_timeout_per_request_is_bounded(server):
    critic = make(server, timeout=0.3, max_retries=1)
    server.script(hang(30), hang(30))
    start = time.monotonic()
    assert critic.generate(["slow"]) == [None]
    assert time.monotonic() - start < 10  # two 0.3 s timeouts, never the server's 30 s
    m = critic.metrics()
    assert m["critic/timeouts"] == 2 and m["critic/failures"] == 1


def test_batch_deadline_never_blocks_forever(server):
    critic = make(server, timeout=20.0, max_retries=0, batch_timeout=3.0)
    server.script(hang(30, match="stuck"))
    start = time.monotonic()
    answers = critic.generate(["stuck one", "fine two"])
    assert time.monotonic() - start < 10
    assert answers == [None, "Toxic Span 1: two"]
    m = critic.metrics()
    assert m["critic/failures"] == 1 and m["critic/successes"] == 1
    # the stuck request's own timeout is cut to what is left of the batch deadline
    assert m["critic/timeouts"] + m["critic/deadline_exceeded"] == 1
    critic.close()


def test_unreachable_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # nothing listens on `port` any more: connection refused
    critic = OpenAICritic(
        model="m", base_url=f"http://127.0.0.1:{port}/v1", timeout=1.0, max_retries=2, backoff_base=0.01
    )
    assert critic.generate(["a", "b"]) == [None, None]
    m = critic.metrics()
    assert m["critic/connection_errors"] == 6 and m["critic/failures"] == 2 and m["critic/retries"] == 4


def test_concurrency_is_used_and_bounded():
    with FakeOpenAIServer(answer=lambda p: "None identified") as srv:
        critic = make(srv, concurrency=6)
        srv.hold_until(6)  # the first 6 are held until all 6 are in flight: reached only if 6 run at once
        assert critic.generate([f"p{i}" for i in range(18)]) == ["None identified"] * 18
        assert srv.max_in_flight == 6
        srv.reset()
        serial = make(srv, concurrency=1)
        serial.generate(["q1", "q2", "q3"])
        assert srv.max_in_flight == 1


def test_rate_limit_spaces_request_starts(server):
    critic = make(server, concurrency=8, rate_limit=20.0)
    critic.generate(["warm up"])  # the first call's one-off client set-up must not delay the first measured arrival
    server.reset()
    critic.generate([f"p {i}" for i in range(6)])
    t = sorted(r.arrival for r in server.received)
    # 6 starts at most 20 per second: >= 0.25 s from first to last (unlimited, they arrive within a few ms)
    assert t[-1] - t[0] >= 0.25 * 0.6


def test_disk_cache_survives_restart_and_is_keyed_by_params(server, tmp_path):
    cache = tmp_path / "cache"
    prompts = ["cache me a", "cache me b"]
    first = make(server, cache_dir=str(cache))
    answers = first.generate(prompts)
    assert len(server.received) == 2
    assert first.generate(prompts) == answers and len(server.received) == 2
    assert first.metrics()["critic/cache_hits"] == 2
    first.close()

    restarted = make(server, cache_dir=str(cache))  # a new process would see the same files
    assert restarted.generate(prompts) == answers
    assert len(server.received) == 2 and restarted.metrics()["critic/cache_hits"] == 2

    other_params = make(server, cache_dir=str(cache), max_tokens=64)
    other_params.generate(prompts)
    assert len(server.received) == 4  # different generation parameters: not the same critique
    other_model = make(server, cache_dir=str(cache), model="another")
    other_model.generate(prompts[:1])
    assert len(server.received) == 5

    files = [p for p in cache.rglob("*.json")]
    assert len(files) == 5
    for f in files:
        assert DUMMY_KEY not in f.read_text()
        assert set(json.loads(f.read_text())) == {"model", "answer", "parser_version"}


def test_failures_are_not_cached(server, tmp_path):
    critic = make(server, cache_dir=str(tmp_path), max_retries=0)
    server.script(status(500))
    assert critic.generate(["x y"]) == [None]
    assert critic.generate(["x y"]) == ["Toxic Span 1: y"]


def test_api_key_never_leaks(server, caplog, tmp_path):
    caplog.set_level(logging.DEBUG)
    critic = make(server, cache_dir=str(tmp_path), max_retries=1)
    # servers echo keys in error bodies ("Incorrect API key provided: sk-..."): that text must be redacted
    echo = f"Incorrect API key provided: {DUMMY_KEY}"
    server.script(status(500, message=echo), status(401, message=echo), hang(30), hang(30))
    critic.timeout = 0.3
    critic.generate(["a", "b", "c"])
    assert critic._redact(echo) == "Incorrect API key provided: ***"
    assert critic._redact("Authorization: Bearer abc.def") == "Authorization: Bearer ***"
    texts = [caplog.text, repr(critic), str(critic), str(critic.metrics()), str(vars(critic))]
    for text in texts:
        assert DUMMY_KEY not in text
    with pytest.raises(TypeError):
        pickle.dumps(critic)
    for root, _, files in os.walk(tmp_path):
        for name in files:
            assert DUMMY_KEY not in open(os.path.join(root, name)).read()


def test_repr_masks_credentials_in_base_url(server):
    critic = make(server)
    critic.base_url = f"http://user:{DUMMY_KEY}@127.0.0.1:1/v1"
    # the one URL rule of trl_stable.settings.secrets: the credentials go, the server stays
    assert DUMMY_KEY not in repr(critic) and "user" not in repr(critic) and "'http://127.0.0.1:1/v1'" in repr(critic)


def test_missing_key_for_openai_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ValueError, match="OPENAI_API_KEY"):
        OpenAICritic(model="gpt-4o-mini")


@pytest.mark.parametrize(
    "kw", [{"concurrency": 0}, {"timeout": 0}, {"max_retries": -1}, {"rate_limit": 0}]
)  # fmt: skip
def test_invalid_arguments(server, kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        make(server, **kw)


def test_scripted_reply_with_delay_and_submit_overlaps(server):
    critic = make(server, concurrency=4)
    # 1 s, not less: on a loaded CI machine the check below may run a few hundred ms after submit
    server.script(reply("Toxic Span 1: slowpoke", delay=1.0, match="slow"))
    job = critic.submit(["slow one", "fast two"])
    assert not job.done()  # returns immediately; the caller works while the critic answers
    assert job.result() == ["Toxic Span 1: slowpoke", "Toxic Span 1: two"]
    assert job.done()


def test_unsent_counts_each_prompt_once():
    from trl_stable.rewards.critic.jobs import Unsent

    unsent = Unsent(3)
    for k in (0, 1, 1):  # a retry reports its prompt again
        unsent.sent(k)
    assert not unsent.wait(0)
    unsent.sent(2)
    assert unsent.wait(0) and Unsent(0).wait(0)
    calls = []
    told = Unsent(2, on_none_left=lambda: calls.append("none left"))
    told.sent(1)
    assert calls == []
    told.sent(0)
    told.sent(0)  # a retry: told once
    assert calls == ["none left"]
    Unsent(0, on_none_left=lambda: calls.append("empty"))  # no batch, nothing paused: nothing to tell
    assert calls == ["none left"]


def test_wait_sent_returns_once_every_request_is_on_the_wire(server):
    # the server holds every request: each is sent, none answered, so wait_sent returns before any answer
    critic = make(server, concurrency=4)
    server.hold()
    job = critic.submit(["one", "two", "three"])
    job.wait_sent()
    assert not job.done()
    deadline = time.monotonic() + 30
    while len(server.received) < 3 and time.monotonic() < deadline:  # written, so the server reads all three
        time.sleep(0.01)
    assert len(server.received) == 3 and not job.done()
    server.release()
    assert job.result() == ["Toxic Span 1: one", "Toxic Span 1: two", "Toxic Span 1: three"]


def test_wait_sent_returns_for_cached_deduplicated_and_failed_requests(server):
    critic = make(server, concurrency=4, max_retries=0)
    critic.generate(["cached"])
    server.script(status(400, match="bad"))
    job = critic.submit(["cached", "bad", "dup", "dup"])
    job.wait_sent()  # would wait for the deadline (minutes) if a request that ends unsent were not counted
    assert job.result() == ["Toxic Span 1: cached", None, "Toxic Span 1: dup", "Toxic Span 1: dup"]
    assert critic.cache._sending == 0 and critic.cache._quiet.is_set()  # the disk cache's writes are not held


def test_disk_cache_writes_are_held_while_the_batch_is_sent(server, tmp_path):
    critic = make(server, concurrency=4, cache_dir=tmp_path)
    calls = []
    for name in ("pause_writes", "resume_writes"):
        method = getattr(critic.cache, name)
        setattr(critic.cache, name, lambda method=method, name=name: (calls.append(name), method()))
    server.hold()
    job = critic.submit(["one", "two"])
    job.wait_sent()
    assert calls == ["pause_writes", "resume_writes"]  # on the wire, none answered: the writer may go on
    assert critic.cache._sending == 0 and critic.cache._quiet.is_set()
    server.release()
    assert job.result() == ["Toxic Span 1: one", "Toxic Span 1: two"]
    critic.close()


def test_job_deadline_abandons_stuck_requests():
    import concurrent.futures as cf
    import threading

    from trl_stable.rewards import CriticJob
    from trl_stable.rewards.critic.counters import CriticCounters

    release = threading.Event()
    counters = CriticCounters()
    with cf.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(lambda: "done"), pool.submit(lambda: release.wait(30) and "late")]
        job = CriticJob(futures=futures, counters=counters, deadline=time.monotonic() + 1.0)
        assert job.result() == ["done", None]
        release.set()
    snap = counters.snapshot()
    assert snap["deadline_exceeded"] == 1 and snap["failures"] == 1
    assert job.result() == ["done", None]  # settled: asking again does not count again
    assert counters.snapshot()["failures"] == 1


def test_identical_prompts_in_flight_are_sent_once():
    # held by the server until every prompt is submitted: the first "same text" is in flight when its duplicates come
    with FakeOpenAIServer(answer=lambda p: f"Toxic Span 1: {p.split()[-1]}") as srv:
        critic = make(srv, concurrency=4)
        srv.hold()
        job = critic.submit(["same text", "same text", "other text", "same text"])
        srv.release()
        answers = job.result()
        assert answers == ["Toxic Span 1: text"] * 4
        assert sorted(r.prompt for r in srv.received) == ["other text", "same text"]
        m = critic.metrics()
        assert m["critic/deduplicated"] == 2 and m["critic/requests"] == 4 and m["critic/failures"] == 0


def test_memory_cache_is_bounded_lru(server):
    critic = make(server, memory_cache_size=2)
    critic.generate(["m a", "m b"])
    critic.generate(["m a"])  # a hit: "m a" is now the most recent
    critic.generate(["m c"])  # evicts "m b"
    assert len(critic.cache.memory) == 2
    critic.generate(["m a", "m b"])
    assert critic.metrics()["critic/cache_hits"] == 2  # "m a" twice; "m b" was asked again
    assert [r.prompt for r in server.received].count("m b") == 2
    with pytest.raises(ValueError, match="memory_cache_size"):
        make(server, memory_cache_size=-1)


def test_default_batch_deadline_grows_with_queueing_and_rate_limit(server):
    critic = make(server, timeout=2.0, max_retries=1, backoff_max=0.05, retry_after_max=0.5, concurrency=4)
    one = 2.0 * 2 + 0.5 + 5.0  # two attempts and the longest wait between them (a Retry-After up to 0.5 s)
    assert critic.batch_seconds(1) == pytest.approx(one) and critic.batch_seconds(4) == pytest.approx(one)
    assert critic.batch_seconds(9) == pytest.approx(one + 2 * 2.0)  # two more waves of 4 workers
    limited = make(
        server, timeout=2.0, max_retries=1, backoff_max=0.05, retry_after_max=0.5, concurrency=4, rate_limit=2.0
    )
    assert limited.batch_seconds(4) == pytest.approx(one + 4 / 2.0)
    assert make(server, batch_timeout=7.0).batch_seconds(1000) == 7.0


def test_disk_cache_concurrent_writers_never_tear(tmp_path):
    import threading

    from trl_stable.rewards.critic.cache import DiskCache

    caches = [DiskCache(tmp_path) for _ in range(4)]  # four "processes" sharing one directory
    key = DiskCache.key("m", "p", {"t": 0})
    answers = [f"answer {k} " * 200 for k in range(4)]
    seen, stop = [], threading.Event()

    def write(k):
        for _ in range(50):
            caches[k].put(key, answers[k], "m")

    def read():
        while not stop.is_set():
            seen.append(caches[0].get_entry(key))

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    reader.join()
    assert caches[1].get_entry(key) in [(a, None) for a in answers]
    assert all(e is None or e[0] in answers for e in seen)  # never a torn, partly written answer
    assert not list(tmp_path.rglob("*.tmp"))  # no temporary file left behind


# --------------------------------------------------------------------------------------------------------------------
# Concurrency sized to the batch


def test_concurrency_is_sized_to_the_batch_and_capped():
    # each request is held until the gate's count is in flight: reached only if the client sends that many at once
    with FakeOpenAIServer(answer=lambda p: "None identified") as srv:
        critic = make(srv, concurrency=None)
        assert critic.workers == 256
        srv.hold_until(40)
        assert critic.generate([f"p{i}" for i in range(40)]) == ["None identified"] * 40
        assert srv.max_in_flight == 40  # one wave, not 40 / 32 of them
        srv.reset()
        capped = make(srv, concurrency=None, max_concurrency=8)
        srv.hold_until(8)
        capped.generate([f"q{i}" for i in range(12)])
        assert srv.max_in_flight == 8
        critic.close(), capped.close()


def test_workers_are_bounded_by_the_rate_limit(server):
    # 5 starts per second within a 2 s timeout: at most 10 requests can be in flight; more threads would only wait
    assert make(server, concurrency=None, rate_limit=5.0, timeout=2.0).workers == 10
    assert make(server, concurrency=None, rate_limit=0.1, timeout=2.0).workers == 1
    assert make(server, concurrency=3, rate_limit=5.0).workers == 3  # an explicit concurrency wins
    unlimited = make(server, concurrency=None, timeout=2.0, max_retries=0, retry_after_max=0.0, backoff_max=0.0)
    assert unlimited.batch_seconds(64) == pytest.approx(2.0 + 5.0)  # no extra waves for a batch of 64
    with pytest.raises(ValueError, match="max_concurrency"):
        make(server, max_concurrency=0)
    with pytest.raises(ValueError, match="retry_after_max"):
        make(server, retry_after_max=-1.0)


# --------------------------------------------------------------------------------------------------------------------
# Only answers that parse are cached


def parses(answer):
    from trl_stable.rewards import parse_critic_answer

    return parse_critic_answer(answer).ok


def test_garbage_and_empty_answers_are_not_cached_in_memory(server):
    critic = make(server, answer_validator=parses, validator_version="v1")
    server.script(reply("lorem ipsum dolor", match="first"), reply("", match="second"))
    assert critic.generate(["first x", "second y"]) == ["lorem ipsum dolor", ""]  # returned, counted, not kept
    assert critic.metrics()["critic/cache_refused"] == 2 and len(critic.cache.memory) == 0
    assert critic.generate(["first x", "second y"]) == ["Toxic Span 1: x", "Toxic Span 1: y"]  # asked again
    assert len(server.received) == 4 and critic.metrics()["critic/cache_hits"] == 0
    assert critic.generate(["first x", "second y"]) == ["Toxic Span 1: x", "Toxic Span 1: y"]
    assert len(server.received) == 4 and critic.metrics()["critic/cache_hits"] == 2
    critic.close()


def test_default_validator_refuses_blank_answers(server):
    critic = make(server)  # no parser installed (e.g. a judge): only blank answers are refused
    server.script(reply("   ", match="blank"), reply("[[A]]", match="judge"))
    critic.generate(["blank one", "judge two"])
    assert critic.metrics()["critic/cache_refused"] == 1 and len(critic.cache.memory) == 1


def test_garbage_is_not_cached_on_disk_and_a_restart_asks_again(server, tmp_path):
    critic = make(server, cache_dir=str(tmp_path), answer_validator=parses, validator_version="v1")
    server.script(reply("<html>502 Bad Gateway</html>"))
    assert critic.generate(["page a"]) == ["<html>502 Bad Gateway</html>"]
    assert not list(tmp_path.rglob("*.json"))
    critic.close()
    # the server is healthy again
    restarted = make(server, cache_dir=str(tmp_path), answer_validator=parses, validator_version="v1")
    assert restarted.generate(["page a"]) == ["Toxic Span 1: a"]
    assert len(server.received) == 2 and restarted.metrics()["critic/cache_hits"] == 0
    (entry,) = tmp_path.rglob("*.json")
    assert json.loads(entry.read_text())["parser_version"] == "v1"


def test_disk_entries_of_another_parser_version_are_revalidated(server, tmp_path):
    from trl_stable.rewards.critic.cache import DiskCache

    critic = make(server, cache_dir=str(tmp_path), answer_validator=parses, validator_version="v2")
    disk = DiskCache(tmp_path)
    key = lambda prompt: DiskCache.key(critic.model, prompt, critic.params)  # noqa: E731
    disk.put(key("still good"), "Toxic Span 1: good", critic.model, parser_version="v1")
    disk.put(key("now garbage"), "garbage the old parser took", critic.model, parser_version="v1")
    disk.put(key("legacy file"), "Toxic Span 1: legacy", critic.model)  # written before versions existed
    disk.put(key("same version"), "garbage v2 itself stored", critic.model, parser_version="v2")
    answers = critic.generate(["still good", "now garbage", "legacy file", "same version"])
    assert answers == [
        "Toxic Span 1: good",
        "Toxic Span 1: garbage",
        "Toxic Span 1: legacy",
        "garbage v2 itself stored",
    ]
    m = critic.metrics()
    assert m["critic/cache_revalidated"] == 2 and m["critic/cache_hits"] == 3
    assert [r.prompt for r in server.received] == ["now garbage"]  # the rejected entry was asked again
    assert disk.get_entry(key("still good")) == ("Toxic Span 1: good", "v2")  # rewritten under this version
    assert disk.get_entry(key("now garbage")) == ("Toxic Span 1: garbage", "v2")


# --------------------------------------------------------------------------------------------------------------------
# Retry-After in all its forms


def test_parse_retry_after_forms():
    from trl_stable.rewards.critic.transport import parse_retry_after

    now = 1_700_000_000.0
    assert parse_retry_after({"Retry-After": "20"}) == 20.0
    assert parse_retry_after({"retry-after": "1.5"}) == 1.5
    assert parse_retry_after({"Retry-After": formatdate(now + 30)}, now=now) == 30.0
    assert parse_retry_after({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, now=now) == 0.0  # in the past
    assert parse_retry_after({"retry-after-ms": "250"}) == 0.25
    assert parse_retry_after({"retry-after-ms": "250", "Retry-After": "9"}) == 0.25  # the finer one first
    assert parse_retry_after({"retry-after-ms": "soon", "Retry-After": "9"}) == 9.0
    for bad in ({"Retry-After": "soon"}, {"Retry-After": "-3"}, {"Retry-After": "nan"}, {}, None):
        assert parse_retry_after(bad) is None


def record_waits(critic):
    """Replace the critic's backoff wait with a recorder: each wait is kept instead of slept."""
    waits = []

    def sleep(seconds):
        waits.append(seconds)
        return False

    critic._sleep = sleep
    return waits


@pytest.mark.parametrize(
    "headers, expected",
    [
        ({"Retry-After": "20"}, 20.0),  # above backoff_max (8 s): no longer cut to it
        ({"retry-after-ms": "1500"}, 1.5),
        ({"Retry-After": "120"}, 60.0),  # cut to retry_after_max
    ],
)
def test_retry_after_is_waited_up_to_its_ceiling(server, headers, expected, caplog):
    critic = make(server, backoff_base=0.01, backoff_max=8.0, retry_after_max=60.0, timeout=2.0)
    waits = record_waits(critic)
    server.script(status(429, headers=headers))
    with caplog.at_level(logging.WARNING):
        assert critic.generate(["a b"]) == ["Toxic Span 1: b"]
    assert waits == [pytest.approx(expected)]
    assert ("retry after" in caplog.text) == (expected > 8.0)  # a long wait is logged
    assert ("retry_after_max=60" in caplog.text) == (expected == 60.0)


def test_retry_after_http_date_and_on_503(server):

    critic = make(server, backoff_base=0.01, timeout=2.0)
    waits = record_waits(critic)
    server.script(status(503, headers={"Retry-After": formatdate(time.time() + 30)}))
    assert critic.generate(["a b"]) == ["Toxic Span 1: b"]
    (wait,) = waits
    assert 28.0 <= wait <= 30.0  # an HTTP-date has whole seconds
    assert critic.metrics()["critic/server_errors"] == 1


# --------------------------------------------------------------------------------------------------------------------
# A rejected key


@pytest.mark.parametrize("code", [401, 403])
def test_rejected_key_stops_further_requests_and_names_the_variable(server, code, monkeypatch):
    monkeypatch.setenv("MY_CRITIC_KEY", DUMMY_KEY)
    critic = make(server, concurrency=1, api_key_env="MY_CRITIC_KEY")
    server.script(status(code, message=f"Incorrect API key provided: {DUMMY_KEY}"))
    assert critic.generate(["a", "b", "c"]) == [None, None, None]
    assert len(server.received) == 1  # the first rejection ends the batch's other requests before they are sent
    m = critic.metrics()
    assert m["critic/auth_errors"] == 1 and m["critic/client_errors"] == 1 and m["critic/failures"] == 3
    message = critic.fatal_error()
    assert "MY_CRITIC_KEY" in message and server.base_url in message and f"HTTP {code}" in message
    assert DUMMY_KEY not in message


def test_fatal_error_without_env_key_says_argument(server):
    critic = make(server, api_key=DUMMY_KEY, concurrency=1)
    server.script(status(401))
    critic.generate(["a"])
    assert "api_key argument" in critic.fatal_error() and DUMMY_KEY not in critic.fatal_error()
