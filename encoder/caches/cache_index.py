"""The node cache's shared index: counters plus one fixed record per entry, in one mmap'ed file.

::

    index file
    [0, 4096)                    header: magic, version, nslots, then u64 counters (COUNTERS)
    [4096 + 136*i, +136)         record i: used, pins, size, created_ns, last_access_ns, hits,
                                 lease_until_ns, key

Entry files are the truth about what is cached; the index is the bookkeeping that makes LRU
eviction and statistics O(1) syscalls: a victim is the used record with the smallest
``last_access_ns`` (a numpy scan of the records, no directory walk), and ``get`` bumps
``last_access_ns``/``hits`` of the slot written in the entry's header.

Every write happens under the cache's FileLock, so counters never lose increments. Readers
(stats, entries, the inspector) read without the lock: a value may be one update stale, never
torn in a way that matters (each field is one aligned 8-byte store).

Crash safety comes from ordering, not from transactions: a record is added *before* its file
gets its final name and removed *after* the file is unlinked. A crash in between leaves a
record without a file, which only over-counts ``used_bytes`` (so the budget still holds) until
the next ``EmbedCache.sweep`` rebuilds the index from the directory.

Leases (``cache_lease.py``): ``pins`` counts the holders of a record and ``lease_until_ns`` is
the latest expiry any of them asked for. A record is *protected* (never an eviction victim)
while ``pins > 0`` and ``lease_until_ns`` is in the future; a holder that crashed never
releases, so its pin stops protecting once the expiry passes, and the next lease of an expired
record starts the count afresh. Times are ``time.time_ns`` (CLOCK_REALTIME), as the LRU stamps
already are: every process of the node reads the same clock, and unlike CLOCK_MONOTONIC it does
not restart with a reboot, which a cache directory on disk (no /dev/shm) survives.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np

MAGIC = b"EPDINDEX"
VERSION = 3  # 3: pins and lease_until_ns (136-byte records)
HEADER_BYTES = 4096
KEY_BYTES = 88
RECORD = np.dtype(
    [
        ("used", "<u4"),
        ("pins", "<u4"),  # holders of a lease on the record (cache_lease.py)
        ("size", "<u8"),
        ("created_ns", "<u8"),
        ("last_access_ns", "<u8"),
        ("hits", "<u8"),
        ("lease_until_ns", "<u8"),  # the latest expiry a holder asked for (time.time_ns)
        ("key", f"S{KEY_BYTES}"),
    ]
)
assert RECORD.itemsize == 136
COUNTERS: tuple[str, ...] = (
    "capacity_bytes",
    "used_bytes",
    "entries",
    "hits",
    "misses",
    "inserts",
    "evictions",
    "evicted_bytes",
    "removals",
    "sweeps",
    # the shared store below the node cache (``embedding_tier.py``), as this node saw it
    "store_hits",
    "store_misses",
    "store_corrupt",
    "store_puts",
)
_COUNTER_OFFSET = 64  # magic(8) version(4) nslots(4), then padding to 64


class Record(NamedTuple):
    slot: int
    key: str
    size: int
    created_ns: int
    last_access_ns: int
    hits: int
    pins: int = 0
    lease_until_ns: int = 0

    def protected(self, now_ns: int) -> bool:
        """Leased and the lease has not expired: no eviction may take it."""
        return self.pins > 0 and self.lease_until_ns > now_ns


class SharedIndex:
    """The mmap'ed index file. Mutating methods must be called with the cache lock held."""

    def __init__(self, path: Path, nslots: int, read_only: bool = False) -> None:
        """Open ``path``; when missing or of another version (and not ``read_only``) it is
        (re)created empty with ``nslots`` records. Call with the cache lock held unless read-only."""
        self.path = path
        self.read_only = read_only
        if not read_only and not self.valid_file(path):
            self._create(path, nslots)
        fd = os.open(path, os.O_RDONLY if read_only else os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ if read_only else mmap.ACCESS_WRITE)
        finally:
            os.close(fd)
        head = np.frombuffer(self._mm, dtype="<u4", count=4, offset=8)
        self.nslots = int(head[1])
        assert bytes(self._mm[:8]) == MAGIC and int(head[0]) == VERSION, f"{path} is not an index"
        assert size == HEADER_BYTES + self.nslots * RECORD.itemsize, f"{path} has the wrong size"
        self._counters = np.frombuffer(self._mm, dtype="<u8", count=len(COUNTERS), offset=_COUNTER_OFFSET)
        self.rec = np.frombuffer(self._mm, dtype=RECORD, count=self.nslots, offset=HEADER_BYTES)

    @staticmethod
    def valid_file(path: Path) -> bool:
        """Whether ``path`` is an index of this version with a consistent size."""
        try:
            with open(path, "rb") as f:
                head = f.read(16)
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            return False
        if len(head) < 16 or head[:8] != MAGIC:
            return False
        version, nslots = np.frombuffer(head, dtype="<u4", count=2, offset=8)
        return int(version) == VERSION and size == HEADER_BYTES + int(nslots) * RECORD.itemsize

    @staticmethod
    def _create(path: Path, nslots: int) -> None:
        # Build the file under a private name and rename it: a reader never maps a half-built index.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
        header = bytearray(HEADER_BYTES)
        header[:8] = MAGIC
        header[8:16] = np.array([VERSION, nslots], dtype="<u4").tobytes()
        with open(tmp, "wb") as f:
            f.write(header)
            f.truncate(HEADER_BYTES + nslots * RECORD.itemsize)
        os.replace(tmp, path)

    # counters -----------------------------------------------------------------------------
    def counter(self, name: str) -> int:
        return int(self._counters[COUNTERS.index(name)])

    def add(self, name: str, delta: int = 1) -> None:
        i = COUNTERS.index(name)
        self._counters[i] = max(0, int(self._counters[i]) + delta)

    def set(self, name: str, value: int) -> None:
        self._counters[COUNTERS.index(name)] = value

    # records ------------------------------------------------------------------------------
    def used_count(self) -> int:
        return self.counter("entries")

    def find(self, key: str) -> int | None:
        """The slot of ``key``, or None (a vectorized scan; use the slot in the entry header
        when you have it)."""
        hit = np.flatnonzero((self.rec["used"] == 1) & (self.rec["key"] == key.encode("ascii")))
        return int(hit[0]) if len(hit) else None

    def has_free_slot(self) -> bool:
        # From the records, not the "entries" counter: a crash inside insert/remove can leave
        # the counter one off until the next sweep, and the slot search must never come up empty.
        return not bool(self.rec["used"].all())

    def insert(
        self,
        key: str,
        size: int,
        created_ns: int,
        last_access_ns: int,
        hits: int = 0,
        pins: int = 0,
        lease_until_ns: int = 0,
    ) -> int:
        """Add a record and count its bytes; the caller made sure a slot is free. ``pins`` and
        ``lease_until_ns``: a lease the record carries over (``sweep``); a new entry has none."""
        slot = int(np.argmin(self.rec["used"]))  # first free slot
        assert self.rec["used"][slot] == 0, "insert into a full index: evict first"
        r = self.rec[slot]
        r["size"], r["created_ns"], r["last_access_ns"], r["hits"] = size, created_ns, last_access_ns, hits
        r["pins"], r["lease_until_ns"] = pins, lease_until_ns
        r["key"] = key.encode("ascii")
        r["used"] = 1  # last: a lock-free reader never sees a used record with a stale key
        self.add("used_bytes", size)
        self.add("entries")
        return slot

    def remove(self, slot: int) -> None:
        r = self.rec[slot]
        if r["used"]:
            r["used"] = 0
            self.add("used_bytes", -int(r["size"]))
            self.add("entries", -1)

    def touch(self, slot: int, key: str, now_ns: int) -> bool:
        """Record one read of ``key`` at ``slot``; False when the slot holds another key."""
        if not 0 <= slot < self.nslots:
            return False
        r = self.rec[slot]
        if not r["used"] or r["key"] != key.encode("ascii"):
            return False
        r["last_access_ns"] = max(int(r["last_access_ns"]), now_ns)
        r["hits"] = int(r["hits"]) + 1
        return True

    def _protected(self, now_ns: int) -> np.ndarray:
        rec = self.rec
        return (rec["used"] == 1) & (rec["pins"] > 0) & (rec["lease_until_ns"] > now_ns)  # type: ignore[no-any-return]

    def oldest(self, now_ns: int) -> Record | None:
        """The least recently used record that no unexpired lease protects (the eviction victim),
        or None when there is none."""
        # One pass: free and protected slots rank after every evictable one.
        evictable = (self.rec["used"] == 1) & ~self._protected(now_ns)
        stamps = np.where(evictable, self.rec["last_access_ns"], np.iinfo(np.uint64).max)
        slot = int(np.argmin(stamps))
        return self.record(slot) if evictable[slot] else None

    def leased(self, now_ns: int) -> tuple[int, int]:
        """(records, bytes) that unexpired leases protect now."""
        mask = self._protected(now_ns)
        return int(mask.sum()), int(self.rec["size"][mask].sum())

    def any_used(self) -> bool:
        return bool(self.rec["used"].any())

    def pin(self, slot: int, until_ns: int, now_ns: int) -> None:
        """One more holder of ``slot`` until ``until_ns``. The pins of a record whose lease had
        expired belong to holders that are gone or late: the count starts afresh."""
        r = self.rec[slot]
        expired = int(r["lease_until_ns"]) <= now_ns
        r["pins"] = 1 if expired else int(r["pins"]) + 1
        r["lease_until_ns"] = until_ns if expired else max(int(r["lease_until_ns"]), until_ns)

    def unpin(self, slot: int, key: str, created_ns: int) -> None:
        """One holder fewer of the entry that was leased: the same key, written at the same time
        (not a later entry of that key), at ``slot`` or where a sweep has moved it since."""
        kb = key.encode("ascii")
        r = self.rec[slot]
        if not (r["used"] and r["key"] == kb):
            found = self.find(key)
            if found is None:
                return
            r = self.rec[found]
        if int(r["created_ns"]) == created_ns:
            r["pins"] = max(0, int(r["pins"]) - 1)

    def record(self, slot: int) -> Record:
        r = self.rec[slot]
        return Record(
            slot=slot,
            key=bytes(r["key"]).decode("ascii"),
            size=int(r["size"]),
            created_ns=int(r["created_ns"]),
            last_access_ns=int(r["last_access_ns"]),
            hits=int(r["hits"]),
            pins=int(r["pins"]),
            lease_until_ns=int(r["lease_until_ns"]),
        )

    def records(self) -> list[Record]:
        return [self.record(int(s)) for s in np.flatnonzero(self.rec["used"] == 1)]

    def clear_records(self) -> None:
        self.rec["used"] = 0
        self.set("used_bytes", 0)
        self.set("entries", 0)

    def close(self) -> None:
        """Unmap the index; closing twice is a no-op."""
        if self._mm.closed:
            return
        # numpy views hold buffer exports on the mmap; drop them before closing it.
        del self.rec, self._counters
        self._mm.close()
