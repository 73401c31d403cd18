"""A real radix prefix cache driven by a seeded random trace of what an engine does to it, with
its KV events recorded: the source of truth the router's index is checked against."""

from __future__ import annotations

import random

from llm_core.caches.page_pool import PagePool
from llm_core.caches.radix_cache import NOT_RESIDENT, PrefixLock, RadixCache

P = 4


class Trace:
    """A real RadixCache with its pools, driven by a seeded random trace of what an engine does.

    ``window``: one window group's window, or a tuple of several (one KV group each, after the
    full-attention group)."""

    def __init__(
        self, seed: int, window: int | tuple[int, ...], window_aware: bool = True, pages: int = 48
    ) -> None:
        self.rng = random.Random(seed)
        windows = (window,) if isinstance(window, int) else window
        self.windows: tuple[int | None, ...] = (None, *windows)
        self.pools = [PagePool(pages, P, f"group{g}") for g in range(len(self.windows))]
        self.cache = RadixCache(
            P, self.windows, [pool.free for pool in self.pools], window_aware=window_aware, record_events=True
        )
        self.window_aware = window_aware
        self.keys: list[list[int]] = []
        self.locks: list[PrefixLock] = []

    def new_key(self) -> list[int]:
        rng = self.rng
        base = rng.choice(self.keys) if self.keys and rng.random() < 0.75 else []
        cut = rng.randint(0, len(base) // P) * P
        return base[:cut] + [rng.randint(0, 2) for _ in range(rng.randint(1, 6) * P)]

    def step(self) -> None:
        rng, cache = self.rng, self.cache
        op = rng.random()
        if op < 0.45:
            self.insert(self.new_key())
        elif op < 0.55 and self.keys:
            # a running request holds a hit: its path cannot be evicted, its window not tombstoned
            m = cache.match_prefix(rng.choice(self.keys))
            if m.length:
                self.locks.append(cache.lock(m.node))
        elif op < 0.65 and self.locks:
            cache.unlock(self.locks.pop(rng.randrange(len(self.locks))))
        elif op < 0.85:
            cache.evict_window(rng.randint(1, 8), rng.randrange(1, len(self.windows)))
        else:
            cache.evict_full(rng.randint(1, 8))

    def insert(self, key: list[int]) -> None:
        n = len(key) // P
        full = self.pools[0]
        if full.num_free < n:
            self.cache.evict_full(n - full.num_free)
        fp = full.alloc(n)
        if fp is None:
            return
        rows: list[list[int]] = [fp]
        for g, pool in enumerate(self.pools[1:], start=1):
            if not self.window_aware and pool.num_free < n:
                self.cache.evict_window(n - pool.num_free, g)  # unaware: every page keeps its window KV
            row: list[int] = []
            for _ in range(n):
                # a finished sequence's early window pages may have left its window (tombstones in
                # the insert), and a full pool gives none; a live tail over a tombstone heals it
                got = pool.alloc(1) if (self.rng.random() < 0.75 or not self.window_aware) else None
                row.append(got[0] if got else NOT_RESIDENT)
            rows.append(row)
        if not self.window_aware and any(NOT_RESIDENT in row for row in rows):
            for pool, row in zip(self.pools, rows, strict=False):
                pool.free([x for x in row if x != NOT_RESIDENT])
            return
        res = self.cache.insert(key, *rows)
        for pool, freed in zip(self.pools, res.to_free, strict=True):
            pool.free(freed)
        self.keys.append(key)

    def probes(self) -> list[list[int]]:
        """Inserted keys, their prefixes cut anywhere (partial pages too), and branches off them."""
        rng = self.rng
        out: list[list[int]] = []
        for key in self.keys[-12:]:
            out.append(key)
            out.append(key[: rng.randint(1, len(key))])
            out.append(key + [rng.randint(0, 2) for _ in range(rng.randint(1, 9))])
            cut = rng.randint(0, len(key) // P) * P
            out.append(key[:cut] + [7] * P + key[cut:])
        return out

    def expected(self, key: list[int]) -> int:
        return self.cache.match_prefix(key, len(key) - 1, touch=False).length
