"""The critic's answer cache: recent answers in memory, and optionally on disk (a restarted run does not pay twice)."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from trl_stable.rewards.critic.counters import CriticCounters

logger = logging.getLogger(__name__)


def cache_key(model: str, prompt: str, params: dict[str, Any]) -> str:
    """SHA-256 of (model, prompt, generation parameters); the API key is never part of it."""
    blob = json.dumps({"model": model, "prompt": prompt, "params": params}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class MemoryCache:
    """The most recent answers in memory, least recently used evicted."""

    def __init__(self, size: int) -> None:
        if size < 0:
            raise ValueError(f"memory_cache_size must be >= 0, got {size}.")
        self.size = size
        self._lock = threading.Lock()
        self._items: OrderedDict[str, str] = OrderedDict()

    def get(self, key: str) -> str | None:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
            return self._items.get(key)

    def put(self, key: str, answer: str) -> None:
        with self._lock:
            self._items[key] = answer
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


class DiskCache:
    """Answers on disk, one JSON file per key with the validator version that accepted it; writes are atomic
    (temporary file + rename), so threads and processes can share a directory. A folder that cannot be used (any
    `OSError` but a missing entry) turns the disk cache off with one warning (`broken` says why): a cache only saves
    requests, its failure must never cost an answer."""

    key = staticmethod(cache_key)

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)
        self.broken: str | None = None
        self._made: set[str] = set()  # subdirectories known to exist (a mkdir per write costs a syscall)
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as exc:
            self._fail(exc)

    def _fail(self, exc: OSError) -> None:
        if self.broken is None:
            self.broken = f"{type(exc).__name__}: {exc.strerror or exc}"
            logger.warning(
                "The critic cache folder %s cannot be used (%s): answers are cached in memory only from now on "
                "(none is lost). Make it writable or point critic_cache_dir at a writable folder.",
                self.directory,
                self.broken,
            )

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key[:2], f"{key}.json")

    def get_entry(self, key: str) -> tuple[str, str | None] | None:
        """(answer, the validator version it was stored under) of `key`; None when missing or torn."""
        if self.broken is not None:
            return None
        try:
            with open(self._path(key), encoding="utf-8") as f:
                data = json.load(f)
            answer, version = data.get("answer"), data.get("parser_version")
        except (FileNotFoundError, ValueError, AttributeError):  # not cached (yet), or a torn file: ask again
            return None
        except OSError as exc:
            self._fail(exc)
            return None
        return (answer, version if isinstance(version, str) else None) if isinstance(answer, str) else None

    def put(self, key: str, answer: str, model: str, parser_version: str | None = None) -> None:
        if self.broken is not None:
            return
        path = self._path(key)
        folder = os.path.dirname(path)
        data = json.dumps({"model": model, "answer": answer, "parser_version": parser_version}, ensure_ascii=False)
        # A name no other process or thread writes to (a writer thread writes its files one after another); the
        # rename makes the entry appear whole. Plain os calls: a third cheaper than tempfile + a text wrapper.
        tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
        try:
            if folder not in self._made:
                os.makedirs(folder, exist_ok=True)
                self._made.add(folder)
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), "wb") as f:
                f.write(data.encode("utf-8"))
            os.replace(tmp, path)
        except OSError as exc:
            self._fail(exc)
            with contextlib.suppress(OSError):  # a torn temporary file, if it was created
                os.unlink(tmp)


class AnswerCache:
    """Answers `validator` accepts (else counted as ``cache_refused``: a cached garbage answer would be served to
    every later step and restarted run), in memory and, with a `directory`, on disk. A disk entry of another
    validator version is served only if `validator` accepts it too (``cache_revalidated``).

    Disk writes wait for `write_pending` (the backend calls it when no request is in flight, so that file creation
    never takes CPU from a batch's requests: measured 85 ms of a 256-request stage) or for `max_pending` answers;
    a writer thread writes them in order, and `flush` waits for it. Between `pause_writes` and `resume_writes` (a
    batch being sent) the writer waits, for up to `max_pause` seconds per call of `write_pending`: the files of one
    step, still being written when the next one starts, would otherwise hold the GIL its threads send with (measured
    +10 ms on a 64-request stage). A process killed mid-batch loses that batch's entries, never a finished one."""

    def __init__(
        self,
        counters: CriticCounters,
        validator: Callable[[str], bool],
        version: str,
        model: str,
        memory_size: int = 4096,
        directory: str | os.PathLike | None = None,
        max_pending: int = 1024,
        max_pause: float = 1.0,
    ) -> None:
        self.counters = counters
        self.validator = validator
        self.version = version
        self.model = model
        self.memory = MemoryCache(memory_size)
        self.disk = DiskCache(directory) if directory is not None else None
        self.max_pending = max_pending
        self._pending: list[tuple[str, str]] = []
        self._writer: cf.ThreadPoolExecutor | None = None
        self._writer_lock = threading.Lock()
        self.max_pause = max_pause
        self._sending = 0  # batches between pause_writes and resume_writes
        self._quiet = threading.Event()
        self._quiet.set()

    def _valid(self, answer: str) -> bool:
        try:
            return bool(self.validator(answer))
        except Exception:  # noqa: BLE001 - a validator bug must not fail the request; the answer is just not cached
            logger.warning("The critic answer validator raised; the answer is not cached.", exc_info=True)
            return False

    def get(self, key: str) -> str | None:
        answer = self.memory.get(key)  # only validated answers get there
        entry = self.disk.get_entry(key) if answer is None and self.disk is not None else None
        if entry is not None:
            answer, version = entry
            if version != self.version:  # another parser version's entry: served only if this one accepts it too
                if not self._valid(answer):
                    return None
                self.counters.add("cache_revalidated")
                self.disk.put(key, answer, self.model, self.version)
            self.memory.put(key, answer)
        if answer is not None:
            self.counters.add("cache_hits")
        return answer

    def put(self, key: str, answer: str) -> None:
        """Keep `answer` (in memory now, on disk at the next `write_pending`) if the validator accepts it."""
        if not self._valid(answer):
            self.counters.add("cache_refused")
            return
        self.memory.put(key, answer)
        if self.disk is not None and self.disk.broken is None:
            with self._writer_lock:
                self._pending.append((key, answer))
                full = len(self._pending) >= self.max_pending
            if full:
                self.write_pending()

    def pause_writes(self) -> None:
        with self._writer_lock:
            self._sending += 1
            self._quiet.clear()

    def resume_writes(self) -> None:
        with self._writer_lock:
            self._sending -= 1
            if not self._sending:
                self._quiet.set()

    def _write(self, entries: list[tuple[str, str]]) -> None:
        until = time.monotonic() + self.max_pause
        for key, answer in entries:
            self._quiet.wait(max(0.0, until - time.monotonic()))
            self.disk.put(key, answer, self.model, self.version)

    def write_pending(self) -> cf.Future | None:
        """Hand the answers `put` since the last call to the writer thread; the future of their write."""
        with self._writer_lock:
            entries, self._pending = self._pending, []
            if not entries and self._writer is None:
                return None
            if self._writer is None:
                self._writer = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="critic-cache")
            return self._writer.submit(self._write, entries)  # one writer thread, in order

    def flush(self) -> None:
        """Wait until every answer `put` so far is on disk."""
        future = self.write_pending()
        if future is not None:
            future.result()

    def close(self) -> None:
        """Flush, and stop the writer thread (a later `put` starts another)."""
        self.write_pending()
        with self._writer_lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)
