"""DiskStore: round trips, TTL, the byte budget under LRU, several processes on one directory, claims.

"Another process" is a second ``DiskStore`` on the same directory (the code path is the same: each
instance has its own in-memory LRU and sees the other's files only on disk), or plain file
operations on the directory.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest

from epd_common.store import StoreError
from epd_common.store.disk_store import _HEADER, DiskStore


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def entry_size(key: str, nbytes: int) -> int:
    return _HEADER.size + len(key) + nbytes


def files_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in (directory / "data").iterdir())


def test_round_trip_batch(tmp_path: Path) -> None:
    s = DiskStore(tmp_path, 1 << 20)
    s.put(
        [("epd:a", b"alpha"), ("epd:b", bytearray(b"beta")), ("epd:c", memoryview(b"gamma")), ("epd:e", b"")]
    )
    assert s.exists(["epd:a", "epd:b", "epd:c", "epd:d", "epd:e"]) == [True, True, True, False, True]
    assert s.get(["epd:c", "epd:d", "epd:a", "epd:b", "epd:e"]) == [b"gamma", None, b"alpha", b"beta", b""]
    assert s.get([]) == [] and s.exists([]) == []
    s.delete(["epd:a", "epd:zz"])
    assert s.get(["epd:a"]) == [None]
    st = s.stats()
    assert (st.kind, st.entries, st.hits, st.misses, st.puts) == ("disk", 3, 4, 2, 4)
    assert st.bytes == files_bytes(tmp_path)


def test_replacing_a_key_counts_its_bytes_once(tmp_path: Path) -> None:
    s = DiskStore(tmp_path, 1 << 20)
    s.put([("epd:a", b"x" * 100)])
    s.put([("epd:a", b"y" * 10)])
    assert s.get(["epd:a"]) == [b"y" * 10]
    assert s.stats().entries == 1 and s.stats().bytes == entry_size("epd:a", 10) == files_bytes(tmp_path)


def test_a_reopened_store_sees_the_entries(tmp_path: Path) -> None:
    DiskStore(tmp_path, 1 << 20).put([("epd:a", b"1"), ("epd:b", b"22")])
    s = DiskStore(tmp_path, 1 << 20)
    assert s.stats().entries == 2 and s.stats().bytes == files_bytes(tmp_path)
    assert s.get(["epd:a", "epd:b"]) == [b"1", b"22"]


def test_ttl_expiry(tmp_path: Path) -> None:
    clock = Clock()
    s = DiskStore(tmp_path, 1 << 20, clock=clock)
    s.put([("epd:short", b"s")], ttl_s=10)
    s.put([("epd:long", b"l")], ttl_s=100)
    s.put([("epd:forever", b"f")])
    clock.t += 9.9
    assert s.get(["epd:short", "epd:long", "epd:forever"]) == [b"s", b"l", b"f"]
    clock.t += 0.2
    assert s.exists(["epd:short", "epd:long", "epd:forever"]) == [False, True, True]
    assert s.get(["epd:short"]) == [None]
    assert s.stats().entries == 2 == len(list((tmp_path / "data").iterdir()))  # the expired file is gone
    clock.t += 1e6
    assert s.get(["epd:long", "epd:forever"]) == [None, b"f"]


def test_too_large(tmp_path: Path) -> None:
    s = DiskStore(tmp_path, 1000)
    with pytest.raises(StoreError) as e:
        s.put([("epd:ok", b"x"), ("epd:big", b"x" * 1000)])
    assert e.value.reason == "too_large" and "epd:big" in str(e.value)
    assert s.get(["epd:ok"]) == [None]  # the batch is checked before anything is written
    s.put([("epd:fits", b"x" * (1000 - entry_size("epd:fits", 0)))])
    assert s.stats().bytes == 1000


def test_lru_eviction_keeps_the_recently_used(tmp_path: Path) -> None:
    one = entry_size("epd:k0", 1000)
    s = DiskStore(tmp_path, 5 * one)
    s.put([(f"epd:k{i}", bytes([i]) * 1000) for i in range(5)])
    assert s.stats().entries == 5
    assert s.get(["epd:k0"]) == [b"\0" * 1000]  # k0 is now the most recent; k1 the least
    s.put([("epd:k5", b"5" * 1000)])
    assert s.exists([f"epd:k{i}" for i in range(6)]) == [True, False, True, True, True, True]
    s.put([("epd:k6", b"6" * 1000), ("epd:k7", b"7" * 1000)])
    assert s.exists([f"epd:k{i}" for i in range(8)]) == [True, False, False, False, True, True, True, True]
    assert s.stats().bytes == files_bytes(tmp_path) <= 5 * one


def test_budget_holds_under_random_operations(tmp_path: Path) -> None:
    rng = random.Random(0)
    budget = 20_000
    s = DiskStore(tmp_path, budget)
    for _ in range(300):
        key = f"epd:k{rng.randrange(40)}"
        op = rng.random()
        if op < 0.5:
            s.put([(key, rng.randbytes(rng.randrange(0, 3000)))], ttl_s=rng.choice([None, 60.0]))
        elif op < 0.9:
            s.get([key])
        else:
            s.delete([key])
        st = s.stats()
        assert st.bytes == files_bytes(tmp_path) <= budget
        assert st.entries == len(list((tmp_path / "data").iterdir()))


def test_another_process_deleting_files(tmp_path: Path) -> None:
    one = entry_size("epd:k0", 1000)
    s = DiskStore(tmp_path, 4 * one)
    s.put([(f"epd:k{i}", b"x" * 1000) for i in range(4)])
    for p in (tmp_path / "data").iterdir():  # e.g. an operator's rm, or another process's eviction
        p.unlink()
    assert s.get(["epd:k0", "epd:k1"]) == [None, None]
    assert s.exists(["epd:k2"]) == [False]
    s.delete(["epd:k3"])
    s.put([(f"epd:n{i}", b"y" * 1000) for i in range(6)])  # evicts past the vanished files
    assert s.exists([f"epd:n{i}" for i in range(6)]) == [False, False, True, True, True, True]
    assert s.stats().bytes == files_bytes(tmp_path) <= 4 * one


def test_two_processes_share_a_directory(tmp_path: Path) -> None:
    one = entry_size("epd:k0", 1000)
    a = DiskStore(tmp_path, 5 * one)
    a.put([(f"epd:k{i}", bytes([i]) * 1000) for i in range(5)])
    b = DiskStore(tmp_path, 5 * one)  # its scan at open finds a's files
    assert b.stats().entries == 5
    time.sleep(0.01)
    assert b.get(["epd:k0"]) == [b"\0" * 1000]  # touches k0's mtime: a's LRU does not know
    b.put([("epd:b0", b"b" * 1000)])  # b evicts its least recent, k1 (a still lists it)
    # a's LRU head is k0, read by b since: it moves to the recent end; k1 vanished: forgotten
    a.put([("epd:a0", b"a" * 1000)])
    a.put([("epd:a1", b"a" * 1000)])  # now a evicts k2
    assert a.exists(["epd:k0", "epd:k1", "epd:k2", "epd:k3"]) == [True, False, False, True]
    assert b.get(["epd:a0", "epd:a1", "epd:b0"]) == [b"a" * 1000] * 2 + [b"b" * 1000]
    # each process keeps its own view under budget; b's entry is over it until a's next rescan
    assert a.stats().bytes <= 5 * one and b.stats().bytes <= 5 * one
    assert files_bytes(tmp_path) <= 6 * one


def test_rescan_picks_up_the_other_processes_files(tmp_path: Path) -> None:
    one = entry_size("epd:k0", 1000)
    a = DiskStore(tmp_path, 4 * one, rescan_interval_s=0.0)
    b = DiskStore(tmp_path, 4 * one)
    b.put([(f"epd:b{i}", b"b" * 1000) for i in range(4)])
    a.put([(f"epd:a{i}", b"a" * 1000) for i in range(2)])  # a rescans at the put: sees b's four
    assert files_bytes(tmp_path) <= 4 * one
    assert a.exists(["epd:a0", "epd:a1"]) == [True, True]


def test_foreign_damaged_and_truncated_files_are_misses(tmp_path: Path) -> None:
    s = DiskStore(tmp_path, 1 << 20)
    s.put([("epd:a", b"A" * 100), ("epd:b", b"B" * 100), ("epd:c", b"C" * 100)])
    data = tmp_path / "data"
    path = {k: data / DiskStore._name(k) for k in ("epd:a", "epd:b", "epd:c")}
    os.replace(path["epd:a"], path["epd:b"])  # b's name now holds a's entry (as a hash collision would)
    assert s.get(["epd:b"]) == [None]
    raw = bytearray(path["epd:c"].read_bytes())
    raw[12] ^= 0xFF  # the header crc
    path["epd:c"].write_bytes(raw)
    assert s.get(["epd:c"]) == [None]
    s.put([("epd:c", b"C" * 100)])
    with open(path["epd:c"], "r+b") as f:
        f.truncate(_HEADER.size + 5 + 50)
    assert s.get(["epd:c"]) == [None] and s.exists(["epd:c"]) == [False]
    s.put([("epd:c", b"fresh")])
    assert s.get(["epd:c"]) == [b"fresh"]


def test_claims_single_winner_and_expiry(tmp_path: Path) -> None:
    clock = Clock()
    a = DiskStore(tmp_path, 1 << 20, clock=clock)
    b = DiskStore(tmp_path, 1 << 20, clock=clock)
    assert a.claim("epd:k", 5.0) is True
    assert a.claim("epd:k", 5.0) is False and b.claim("epd:k", 5.0) is False
    assert a.exists(["epd:k"]) == [False]  # a marker is not a value
    b.unclaim("epd:k")  # not b's: nothing happens
    assert b.claim("epd:k", 5.0) is False
    a.unclaim("epd:k")
    assert b.claim("epd:k", 5.0) is True
    clock.t += 5.1  # b's claim lapsed (b died, say): a takes it over
    assert a.claim("epd:k", 5.0) is True
    b.unclaim("epd:k")  # b's late unclaim must not release a's claim
    assert b.claim("epd:k", 5.0) is False
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.parametrize("expired", [False, True])
def test_racing_claimers(tmp_path: Path, expired: bool) -> None:
    clock = Clock()
    stores = [DiskStore(tmp_path, 1 << 20, clock=clock) for _ in range(8)]
    if expired:
        assert stores[0].claim("epd:k", 1.0)
        clock.t += 2.0  # every racer finds an expired marker to take over
    start = threading.Barrier(len(stores))
    won: list[bool] = []

    def race(s: DiskStore) -> None:
        start.wait()
        won.append(s.claim("epd:k", 10.0))

    threads = [threading.Thread(target=race, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(won) == [False] * 7 + [True]


def test_invalid_calls_and_close(tmp_path: Path) -> None:
    s = DiskStore(tmp_path, 1 << 20)
    for call in (
        lambda: s.get(["no-namespace"]),
        lambda: s.put([("epd:a", b"x")], ttl_s=0),
        lambda: s.claim("epd:a", -1),
    ):
        with pytest.raises(StoreError) as e:
            call()
        assert e.value.reason == "invalid"
    s.close()
    with pytest.raises(StoreError) as e:
        s.get(["epd:a"])
    assert e.value.reason == "unavailable"


def test_unusable_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError) as e:
        DiskStore(tmp_path / "file", 1 << 20)
    assert e.value.reason == "unavailable"
    with pytest.raises(ValueError, match="max_bytes"):
        DiskStore(tmp_path, 0)


def test_reopening_with_a_smaller_budget_evicts(tmp_path: Path) -> None:
    one = entry_size("epd:k0", 100)
    DiskStore(tmp_path, 10 * one).put([(f"epd:k{i}", b"x" * 100) for i in range(10)])
    s = DiskStore(tmp_path, 3 * one)
    assert s.stats().entries == 3 and files_bytes(tmp_path) == 3 * one
