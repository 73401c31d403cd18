"""A real radix prefix cache driven by a seeded random trace of what an engine does to it, with
its KV events recorded: the source of truth the router's index is checked against."""

from __future__ import annotations

import random

from llm_core.caches.page_pool import PagePool
from llm_core.caches.radix_cache import NOT_RESIDENT, PrefixLock, RadixCache

P = 4


class Trace:
    """A real RadixCache with its pools, driven by a seeded random trace of what an engine does."""

    def __init__(self, seed: int, window: int, swa_aware: bool = True, pages: int = 48) -> None:
        self.rng = random.Random(seed)
        self.full, self.swa = PagePool(pages, P, "full"), PagePool(pages, P, "swa")
        self.cache = RadixCache(
            P, (None, window), (self.full.free, self.swa.free), swa_aware=swa_aware, record_events=True
        )
        self.swa_aware = swa_aware
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
            cache.evict_swa(rng.randint(1, 8))
        else:
            cache.evict_full(rng.randint(1, 8))

    def insert(self, key: list[int]) -> None:
        n = len(key) // P
        if self.full.num_free < n:
            self.cache.evict_full(n - self.full.num_free)
        fp = self.full.alloc(n)
        if fp is None:
            return
        if not self.swa_aware and self.swa.num_free < n:
            self.cache.evict_swa(n - self.swa.num_free)  # SWA-unaware: every page keeps its SWA KV
        sp: list[int] = []
        for _ in range(n):
            # a finished sequence's early SWA pages may have left its window (tombstones in the
            # insert), and a full SWA pool gives none; a live tail over a tombstone heals it
            got = self.swa.alloc(1) if (self.rng.random() < 0.75 or not self.swa_aware) else None
            sp.append(got[0] if got else NOT_RESIDENT)
        if not self.swa_aware and NOT_RESIDENT in sp:
            self.full.free(fp)
            self.swa.free([s for s in sp if s != NOT_RESIDENT])
            return
        res = self.cache.insert(key, fp, sp)
        self.full.free(res.full_to_free)
        self.swa.free(res.swa_to_free)
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
