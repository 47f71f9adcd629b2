"""A critic cache folder that cannot be used (read-only, a path under a file, a full disk, unreadable entries) turns
the disk cache off with one warning: every answer still arrives, the counters stay those of the requests."""

import errno
import logging
import os

import pytest

import trl_stable.rewards.critic.cache as cache_module
from trl_stable.rewards import CriticIntrinsicReward, CriticRewardConfig, OpenAICritic

try:
    from fake_openai_server import FakeOpenAIServer
except ImportError:
    from tests.rewards.fake_openai_server import FakeOpenAIServer

PROMPTS = ["text one", "text two", "text three"]
ANSWERS = ["Toxic Span 1: one", "Toxic Span 1: two", "Toxic Span 1: three"]


@pytest.fixture
def server():
    with FakeOpenAIServer(answer=lambda prompt: f"Toxic Span 1: {prompt.split()[-1]}") as srv:
        yield srv


@pytest.fixture(autouse=True)
def dummy_key(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-DUMMY-cache-5e1f")


def make(server, cache_dir):
    return OpenAICritic(model="m", base_url=server.base_url, timeout=5.0, max_retries=0, cache_dir=cache_dir)


def _denied(*args, **kwargs):
    raise PermissionError(errno.EACCES, "Permission denied")


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def read_only_files(monkeypatch, tmp_path):
    """A folder whose files cannot be created (what a read-only or immutable folder does, also to root)."""
    monkeypatch.setattr(cache_module.os, "open", _denied)
    return tmp_path / "cache"


def under_a_file(monkeypatch, tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    return tmp_path / "a_file" / "cache"


class _FullFile:
    """A file on a full disk: it opens, its bytes do not fit."""

    def __init__(self, fd, mode):
        self.fd = fd

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        os.close(self.fd)

    write = staticmethod(_full)


def full_disk(monkeypatch, tmp_path):
    monkeypatch.setattr(cache_module.os, "fdopen", _FullFile)
    return tmp_path / "cache"


@pytest.mark.parametrize("broken", [read_only_files, under_a_file, full_disk])
def test_an_unusable_folder_costs_no_answer_and_warns_once(server, tmp_path, monkeypatch, caplog, broken):
    folder = broken(monkeypatch, tmp_path)
    critic = make(server, str(folder))
    with caplog.at_level(logging.WARNING, logger="trl_stable.rewards.critic"):
        assert critic.generate(PROMPTS) == ANSWERS
        assert critic.generate(PROMPTS) == ANSWERS  # the memory cache still serves them
        critic.generate(["text four", "text five"])
    m = critic.metrics()
    assert (m["critic/requests"], m["critic/successes"], m["critic/failures"]) == (8, 8, 0)
    assert (m["critic/attempts"], m["critic/cache_hits"]) == (5, 3)
    assert len(server.received) == 5
    warnings = [r for r in caplog.records if "critic cache folder" in r.getMessage()]
    assert len(warnings) == 1 and str(folder) in warnings[0].getMessage()
    assert critic.cache.disk.broken is not None
    assert not list(tmp_path.rglob("*.json")) and not list(tmp_path.rglob("*.tmp"))
    critic.close()


def test_unreadable_entries_turn_the_disk_cache_off(server, tmp_path, monkeypatch, caplog):
    folder = tmp_path / "cache"
    make(server, str(folder)).generate(PROMPTS)  # a healthy run fills the cache
    assert len(list(folder.rglob("*.json"))) == 3
    monkeypatch.setattr(cache_module, "open", _denied, raising=False)  # then its files cannot be read
    critic = make(server, str(folder))
    with caplog.at_level(logging.WARNING, logger="trl_stable.rewards.critic"):
        assert critic.generate(PROMPTS) == ANSWERS  # asked again instead
    m = critic.metrics()
    assert (m["critic/successes"], m["critic/failures"], m["critic/cache_hits"], m["critic/attempts"]) == (3, 0, 0, 3)
    assert sum("critic cache folder" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes to read-only folders")
def test_a_read_only_folder(server, tmp_path, caplog):
    folder = tmp_path / "cache"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        critic = make(server, str(folder))
        with caplog.at_level(logging.WARNING, logger="trl_stable.rewards.critic"):
            assert critic.generate(PROMPTS) == ANSWERS
        assert critic.metrics()["critic/failures"] == 0
        assert sum("critic cache folder" in r.getMessage() for r in caplog.records) == 1
    finally:
        folder.chmod(0o755)


def test_the_reward_keeps_its_critiques_and_does_not_count_failing_steps(server, tokenizer, tmp_path, monkeypatch):
    folder = read_only_files(monkeypatch, tmp_path)
    cfg = CriticRewardConfig(
        use_intrinsic_reward=True, critic_task="toxicity", critic_backend="openai", critic_base_url=server.base_url,
        critic_cache_dir=str(folder), intrinsic_reward_threshold=1.0, max_consecutive_failing_steps=1,
    )  # fmt: skip
    fn = CriticIntrinsicReward(cfg, tokenizer)
    completions = [" you idiot", " you fool"]
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    for _ in range(3):  # a failing step would raise at once (max_consecutive_failing_steps=1)
        rows = fn(["p", "p"], completions, ids, env_rewards=[0.0, 0.0])
        assert all(row is not None and min(row) < 0 for row in rows)  # the last word of each is a toxic span
    m = fn.metrics()
    assert m["critic/failures"] == 0 and m["critic/failed_answers"] == 0 and fn.consecutive_failing_steps == 0
    fn.close()


def test_disk_writes_wait_for_write_pending_or_max_pending(tmp_path):
    from trl_stable.rewards.critic.cache import AnswerCache, cache_key
    from trl_stable.rewards.critic.counters import CriticCounters

    cache = AnswerCache(CriticCounters(), bool, "v1", "m", directory=tmp_path, max_pending=3)
    keys = [cache_key("m", f"p{i}", {}) for i in range(5)]
    cache.put(keys[0], "a0")
    cache.put(keys[1], "a1")
    assert not list(tmp_path.rglob("*.json"))  # requests may still be in flight: nothing written yet
    assert cache.get(keys[0]) == "a0"  # served from memory meanwhile
    cache.write_pending().result()
    assert sorted(p.stem for p in tmp_path.rglob("*.json")) == sorted(keys[:2])
    for i in (2, 3, 4):  # the third pending answer hands the batch to the writer without a call
        cache.put(keys[i], f"a{i}")
    assert cache._pending == []
    cache.close()
    fresh = AnswerCache(CriticCounters(), bool, "v1", "m", directory=tmp_path)  # a restarted process
    assert [fresh.get(k) for k in keys] == [f"a{i}" for i in range(5)]


def test_disk_writes_wait_while_a_batch_is_sent(tmp_path):
    import threading

    from trl_stable.rewards.critic.cache import AnswerCache, cache_key
    from trl_stable.rewards.critic.counters import CriticCounters

    class Gate(threading.Event):  # tells the test when the writer waits on a closed gate
        waiting = threading.Event()

        def wait(self, timeout=None):
            if not self.is_set():
                self.waiting.set()
            return super().wait(timeout)

    cache = AnswerCache(CriticCounters(), bool, "v1", "m", directory=tmp_path, max_pause=60.0)
    cache._quiet = Gate()
    cache._quiet.set()
    key = cache_key("m", "p", {})
    cache.pause_writes()
    cache.pause_writes()  # two batches being sent (a prefetch and a call)
    cache.put(key, "a")
    future = cache.write_pending()
    assert Gate.waiting.wait(30)  # the writer reached its gate
    cache.resume_writes()
    assert not list(tmp_path.rglob("*.json")) and not future.done()  # one batch is still being sent
    cache.resume_writes()
    future.result()
    assert [p.stem for p in tmp_path.rglob("*.json")] == [key]
    # a batch that never finishes sending holds the writes for max_pause at most
    bounded = AnswerCache(CriticCounters(), bool, "v1", "m", directory=tmp_path / "b", max_pause=0.0)
    bounded.pause_writes()
    bounded.put(key, "b")
    bounded.flush()
    assert bounded.disk.get_entry(key) == ("b", "v1")
    cache.close()
    bounded.close()
