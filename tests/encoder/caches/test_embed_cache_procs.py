"""The node cache under many processes: concurrent writers and readers, and writers killed with
SIGKILL at random moments. Content is derived from the key, so a reader can check every byte."""

import contextlib
import hashlib
import multiprocessing as mp
import os
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from encoder.caches.cache_format import PAGE
from encoder.caches.embed_cache import EmbedCache

CTX = mp.get_context("fork")  # cheap children that already imported torch
COLS = 64


def key(i: int) -> str:
    return hashlib.sha256(f"media-{i}".encode()).hexdigest()


def content(k: str, max_rows: int) -> torch.Tensor:
    # numpy, not torch ops: a forked child must not enter the parent's OpenMP pool.
    seed = int(k[:8], 16)
    rows = 1 + seed % max_rows
    values = (np.arange(rows * COLS, dtype=np.float32) * 7 + seed % 4093) % 4093
    return torch.from_numpy(values.reshape(rows, COLS))


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(np.array_equal(got.numpy(), want.numpy()))


def dir_bytes(root: Path) -> int:
    total = 0
    for e in os.scandir(root / "entries"):
        with contextlib.suppress(FileNotFoundError):  # evicted during the walk
            total += e.stat().st_size
    return total


def writer_proc(root: str, capacity: int, seed: int, n: int, max_rows: int, q: "mp.Queue[str]") -> None:
    try:
        cache = EmbedCache("t", root=root)
        rng = random.Random(seed)
        for _ in range(n):
            k = key(rng.randrange(200))
            cache.put(k, content(k, max_rows), [(1, 2, 2)], "image")
            # Snapshot under the cache lock: no put/evict can interleave with the directory walk.
            assert cache._lock is not None
            with cache._lock.held():
                used = dir_bytes(Path(root))
            assert used <= capacity, f"directory holds {used} > capacity {capacity}"
            assert cache.stats().used_bytes <= capacity
        q.put("ok")
    except BaseException as e:
        q.put(f"writer {seed}: {e!r}")


def reader_proc(root: str, seed: int, duration_s: float, max_rows: int, q: "mp.Queue[str]") -> None:
    try:
        cache = EmbedCache("t", root=root)
        rng = random.Random(seed)
        hits = 0
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            k = key(rng.randrange(200))
            got = cache.get(k)
            if got is not None:
                hits += 1
                want = content(k, max_rows)
                assert same(got.tensor, want), f"{k}: {got.tensor.shape} differs from what was written"
        q.put(f"ok {hits}")
    except BaseException as e:
        q.put(f"reader {seed}: {e!r}")


@pytest.mark.timeout(60)
def test_four_writers_four_readers_small_budget(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    max_rows = 200  # entries of 4 KiB + up to 50 KiB
    capacity = 12 * (PAGE + max_rows * COLS * 4) // 2
    EmbedCache("t", capacity_bytes=capacity, root=root).close()
    q: mp.Queue[str] = CTX.Queue()
    procs = [
        CTX.Process(target=writer_proc, args=(str(root), capacity, s, 150, max_rows, q)) for s in range(4)
    ]
    procs += [CTX.Process(target=reader_proc, args=(str(root), 10 + s, 3.0, max_rows, q)) for s in range(4)]
    for p in procs:
        p.start()
    results = [q.get(timeout=50) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    assert all(r.startswith("ok") for r in results), results
    assert sum(int(r.split()[1]) for r in results if r.startswith("ok ")) > 0  # readers did hit
    cache = EmbedCache("t", root=root)
    report = cache.verify()
    assert report.ok and report.orphan_tmp == 0 and report.unindexed == 0 and report.missing == 0
    s = cache.stats()
    assert s.used_bytes == dir_bytes(root) <= capacity
    assert s.evictions > 0 and s.inserts >= s.entries


def crash_writer(root: str, seed: int, ready: "mp.synchronize.Event") -> None:
    cache = EmbedCache("t", root=root)
    rng = random.Random(seed)
    ready.set()
    while True:  # large entries so that kills land inside writes, renames and evictions
        k = key(rng.randrange(40))
        cache.put(k, content(k, 8192), [(1, 2, 2)], "image")
        if rng.random() < 0.2:
            cache.evict(key(rng.randrange(40)))


def checking_reader(root: str, stop: "mp.synchronize.Event", q: "mp.Queue[str]") -> None:
    try:
        cache = EmbedCache("t", root=root, read_only=True)
        rng = random.Random(0)
        seen = 0
        while not stop.is_set():
            k = key(rng.randrange(40))
            got = cache.get(k)
            if got is not None:
                seen += 1
                assert same(got.tensor, content(k, 8192)), f"torn or wrong entry {k}"
        q.put(f"ok {seen}")
    except BaseException as e:
        q.put(f"reader: {e!r}")


def completes_within(fn: "object", seconds: float) -> bool:
    t = threading.Thread(target=fn, daemon=True)  # type: ignore[arg-type]
    t.start()
    t.join(seconds)
    return not t.is_alive()


@pytest.mark.timeout(90)
def test_writers_killed_mid_write_leave_no_torn_entry_no_lock_no_orphan(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    capacity = 6 * (PAGE + 8192 * COLS * 4)  # room for ~6-12 entries of up to 2 MiB
    cache = EmbedCache("t", capacity_bytes=capacity, root=root)
    q: mp.Queue[str] = CTX.Queue()
    stop = CTX.Event()
    reader = CTX.Process(target=checking_reader, args=(str(root), stop, q))
    reader.start()
    rng = random.Random(1)
    killed_mid_write = 0
    for i in range(50):
        ready = CTX.Event()
        w = CTX.Process(target=crash_writer, args=(str(root), i, ready))
        w.start()
        assert ready.wait(20)
        time.sleep(rng.uniform(0.005, 0.06))
        os.kill(w.pid or 0, signal.SIGKILL)
        w.join()
        assert w.exitcode == -signal.SIGKILL
        # A kill inside put leaves an unlocked tmp file (the next writer's start sweeps it).
        killed_mid_write += len(os.listdir(root / "tmp"))
        # Whatever the writer held, the lock is free now: a put and an evict complete promptly.
        k = key(1000 + i)
        assert completes_within(lambda k=k: cache.put(k, content(k, 16), [(1, 2, 2)], "image"), 5.0)
        assert completes_within(lambda k=k: cache.evict(k), 5.0)
    stop.set()
    result = q.get(timeout=20)
    reader.join()
    assert result.startswith("ok") and int(result.split()[1]) > 0, result
    assert killed_mid_write > 0  # the kills did land inside writes
    reopened = EmbedCache("t", root=root)  # a new start sweeps
    assert os.listdir(root / "tmp") == []
    report = reopened.verify()
    assert report.ok and report.orphan_tmp == 0 and report.unindexed == 0 and report.missing == 0
    assert reopened.stats().used_bytes == dir_bytes(root) <= capacity
    assert reopened.stats().inserts > 0


def put_with_inherited_instance(cache: EmbedCache, q: "mp.Queue[str]") -> None:
    try:
        k = key(5000)
        cache.put(k, content(k, 16), [(1, 2, 2)], "image")
        got = cache.get(k)
        q.put("ok" if got is not None and same(got.tensor, content(k, 16)) else "bad read")
    except BaseException as e:
        q.put(repr(e))


def test_an_instance_inherited_through_fork_gets_its_own_lock(tmp_path: Path) -> None:
    cache = EmbedCache("t", capacity_bytes=1 << 20, root=tmp_path / "cache")
    assert cache._lock is not None
    q: mp.Queue[str] = CTX.Queue()
    with cache._lock.held():  # the child must wait for us, not share our lock
        child = CTX.Process(target=put_with_inherited_instance, args=(cache, q))
        child.start()
        time.sleep(0.2)
        assert q.empty() and not cache.contains(key(5000))
    assert q.get(timeout=20) == "ok"
    child.join(timeout=10)
    assert cache.contains(key(5000)) and completes_within(lambda: cache.evict(key(5000)), 5.0)
