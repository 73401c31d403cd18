"""Leases on node-cache entries (``cache_lease.py``): a leased entry survives the puts of another
process, an expired lease (a crashed holder's) protects nothing, and a put that could only fit by
evicting leased entries fails with ``CacheFull`` instead.

The other process is a real one (``spawn``), driven over a pipe, so the lease is seen through the
shared index file and not through any state of this process."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from encoder.caches.cache_format import PAGE
from encoder.caches.cache_index import VERSION, SharedIndex
from encoder.caches.embed_cache import CacheFull, EmbedCache, NotCached

ROWS, COLS = 4, 16
ENTRY = PAGE + ROWS * COLS * 4
CAPACITY = 2 * ENTRY  # room for two entries


def key(i: int) -> str:
    return hashlib.sha256(f"lease-{i}".encode()).hexdigest()


def put(cache: EmbedCache, i: int) -> None:
    cache.put(key(i), torch.full((ROWS, COLS), float(i)), [(1, 4, 4)], "image")


def cached(cache: EmbedCache, *items: int) -> list[int]:
    return [i for i in items if cache.contains(key(i))]


def _other_process(conn: Connection) -> None:
    """Runs each command it is sent against its own open of the cache; answers with the outcome."""
    cache: EmbedCache | None = None
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "open":
                cache = EmbedCache("t", root=args[0])
                conn.send("ok")
            elif cmd == "put":
                assert cache is not None
                put(cache, args[0])
                conn.send("ok")
            elif cmd == "lease-and-die":  # a holder that crashes without releasing
                assert cache is not None
                cache.lease([key(args[0])], args[1])
                conn.send("ok")
                os._exit(0)
            elif cmd == "quit":
                conn.send("ok")
                return
        except Exception as e:  # the test reads what failed, and how
            conn.send(e)


class Other:
    """A second process of the node, spawned fresh (it imports the cache itself)."""

    def __init__(self, root: Path) -> None:
        self.conn, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(target=_other_process, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        assert self.ask("open", str(root)) == "ok"

    def ask(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        assert self.conn.poll(120), f"the other process did not answer {cmd}"
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            self.ask("quit")
        self.proc.join(30)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def other(root: Path) -> Iterator[Other]:
    EmbedCache("t", capacity_bytes=CAPACITY, root=root).close()
    o = Other(root)
    yield o
    o.close()


def test_a_leased_entry_outlives_another_processes_puts_until_released(root: Path, other: Other) -> None:
    cache = EmbedCache("t", root=root)
    put(cache, 0)
    put(cache, 1)
    lease = cache.lease([key(0)], ttl_s=60)  # 0 is the least recently used: the next victim
    assert other.ask("put", 2) == "ok"
    assert cached(cache, 0, 1, 2) == [0, 2]  # 1 went instead
    assert other.ask("put", 3) == "ok"
    assert cached(cache, 0, 2, 3) == [0, 3]
    # both entries leased: the other process's put fails and evicts nothing
    with cache.lease([key(3)], ttl_s=60):
        err = other.ask("put", 4)
        assert isinstance(err, CacheFull), err
        assert err.needed_bytes == ENTRY and err.leased_bytes == 2 * ENTRY and err.capacity_bytes == CAPACITY
        assert "leased by requests in flight" in str(err)
        assert cached(cache, 0, 3, 4) == [0, 3]
    lease.release()
    lease.release()  # idempotent
    assert other.ask("put", 4) == "ok"
    assert cached(cache, 0, 3, 4) == [3, 4]  # released: 0 was the LRU again and went
    cache.close()


def test_an_expired_lease_protects_nothing_and_a_crashed_holder_is_one(root: Path, other: Other) -> None:
    cache = EmbedCache("t", root=root)
    put(cache, 0)
    put(cache, 1)
    assert other.ask("lease-and-die", 0, 1.0) == "ok"
    other.proc.join(30)
    assert not other.proc.is_alive()
    put(cache, 2)  # within its TTL the dead holder's lease still holds
    assert cached(cache, 0, 1, 2) == [0, 2]
    time.sleep(1.1)
    put(cache, 3)  # expired: 0 is an ordinary LRU victim
    assert cached(cache, 0, 2, 3) == [2, 3]
    # and in-process: a lease past its TTL neither protects nor, when released late, unpins
    # a newer holder's lease
    late = cache.lease([key(2)], ttl_s=0.05)
    time.sleep(0.1)
    fresh = cache.lease([key(2)], ttl_s=60)
    late.release()
    put(cache, 4)  # 2 is the LRU, but the fresh lease holds it
    assert cached(cache, 2, 3, 4) == [2, 4]
    fresh.release()
    cache.close()


def test_a_lease_of_a_missing_key_names_it_and_pins_nothing(root: Path) -> None:
    cache = EmbedCache("t", capacity_bytes=CAPACITY, root=root)
    put(cache, 0)
    put(cache, 1)
    with pytest.raises(NotCached) as ei:
        cache.lease([key(0), key(9)], ttl_s=60)
    assert ei.value.key == key(9) and key(9) in str(ei.value)
    put(cache, 2)  # 0 was not pinned by the failed lease
    assert cached(cache, 0, 1, 2) == [1, 2]
    cache.close()


def test_two_holders_of_one_entry_protect_it_until_both_release(root: Path) -> None:
    cache = EmbedCache("t", capacity_bytes=CAPACITY, root=root)
    put(cache, 0)
    put(cache, 1)
    first, second = cache.lease([key(0)], ttl_s=60), cache.lease([key(0)], ttl_s=60)
    assert first.bytes == ENTRY and first.keys == [key(0)]
    first.release()
    put(cache, 2)
    assert cached(cache, 0, 1, 2) == [0, 2]
    second.release()
    put(cache, 3)
    assert cached(cache, 0, 2, 3) == [2, 3]
    cache.close()


def test_a_sweep_by_a_new_open_keeps_live_leases(root: Path) -> None:
    cache = EmbedCache("t", capacity_bytes=CAPACITY, root=root)
    put(cache, 0)
    put(cache, 1)
    lease = cache.lease([key(0)], ttl_s=60)
    EmbedCache("t", root=root).close()  # every writable open sweeps: the index is rebuilt
    put(cache, 2)
    assert cached(cache, 0, 1, 2) == [0, 2]
    lease.release()  # found where the sweep put it
    put(cache, 3)
    assert cached(cache, 0, 2, 3) == [2, 3]
    cache.close()


def test_an_index_of_the_previous_layout_is_recreated(root: Path) -> None:
    cache = EmbedCache("t", capacity_bytes=CAPACITY, root=root)
    put(cache, 0)
    cache.close()
    index = root / "index"
    data = bytearray(index.read_bytes())
    data[8:12] = (VERSION - 1).to_bytes(4, "little")
    index.write_bytes(bytes(data))
    assert not SharedIndex.valid_file(index)
    cache = EmbedCache("t", capacity_bytes=CAPACITY, root=root)  # recreated, then swept
    assert cached(cache, 0) == [0]
    with cache.lease([key(0)], ttl_s=60) as lease:
        assert lease.bytes == ENTRY
    cache.close()
