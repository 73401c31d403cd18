"""Leases on node-cache entries: what a request is about to read is not evicted under it.

::

    lease = cache.lease([key_a, key_b], ttl_s=40)   # NotCached names a key that is not there
    ...                                             # puts by any process evict around them
    lease.release()                                 # idempotent; also ``with cache.lease(...)``

A lease is bookkeeping in the shared index (``cache_index``: ``pins`` and ``lease_until_ns`` of
each record), written under the cache lock, so it holds across every process of the node. It
ends when released, or when its TTL passes: a holder that crashed never releases, and its pin
stops protecting the entry at the expiry (no sweep or restart needed). A put that finds only
leased entries to evict fails with ``CacheFull`` rather than evict one.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import NamedTuple

from encoder.caches.cache_index import SharedIndex
from encoder.caches.cache_types import CacheError, NotCached, check_key


class _Held(NamedTuple):
    key: str
    slot: int
    created_ns: int  # tells the leased entry from a later one of the same key
    size: int


class CacheLease:
    """Entries of one cache pinned until ``release()`` or ``expires_ns`` (``time.time_ns``)."""

    def __init__(
        self, locked: Callable[[], AbstractContextManager[SharedIndex]], held: list[_Held], expires_ns: int
    ) -> None:
        self._locked = locked
        self._held = held
        self.expires_ns = expires_ns
        self._released = False

    @classmethod
    def take(
        cls,
        locked: Callable[[], AbstractContextManager[SharedIndex]],
        entries_dir: Path,
        keys: Sequence[str],
        ttl_s: float,
    ) -> CacheLease:
        """Pin every key of ``keys`` for ``ttl_s`` seconds, all or none (``NotCached`` names the
        first key that is not cached). ``locked``: the cache lock, yielding the index."""
        if not (math.isfinite(ttl_s) and ttl_s > 0):
            raise CacheError(f"a lease needs a positive ttl_s, got {ttl_s}")
        for key in keys:
            check_key(key)
        held: list[_Held] = []
        with locked() as idx:
            now = time.time_ns()
            until = now + int(ttl_s * 1e9)
            for key in keys:
                slot = idx.find(key)
                # the file too: a crash can leave a record without one until the next sweep
                if slot is None or not os.path.exists(entries_dir / key):
                    raise NotCached(key)
                rec = idx.record(slot)
                held.append(_Held(key, slot, rec.created_ns, rec.size))
            for h in held:  # only once every key was found: all or none
                idx.pin(h.slot, until, now)
        return cls(locked, held, until)

    @property
    def keys(self) -> list[str]:
        return [h.key for h in self._held]

    @property
    def bytes(self) -> int:
        """The leased entries' bytes (each distinct key once)."""
        return sum({h.key: h.size for h in self._held}.values())

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Unpin the entries; a second call does nothing. A lease past its expiry unpins nothing:
        its pins protect nothing any more, and the next lease of the entry has recounted them."""
        if self._released:
            return
        self._released = True
        if time.time_ns() >= self.expires_ns:
            return
        with self._locked() as idx:
            for h in self._held:
                idx.unpin(h.slot, h.key, h.created_ns)

    def __enter__(self) -> CacheLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
