"""The prefix cache's KV events: replaying them gives exactly what the tree holds, page by page."""

from __future__ import annotations

import random

import pytest

from epd_common.messages.kv_events import (
    FULL_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from epd_common.messages.page_hash import page_hashes
from llm_core.caches.page_pool import PagePool
from llm_core.caches.radix_cache import NOT_RESIDENT, RadixCache

P = 4


class Replica:
    """What a consumer of the events knows: hash -> the window groups whose KV of the page is live,
    rebuilt from the events alone."""

    def __init__(self) -> None:
        self.pages: dict[int, frozenset[int]] = {}
        self.tokens: dict[int, tuple[int, ...]] = {}
        self.parents: dict[int, int | None] = {}

    def apply(self, events: list[KVEvent]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                for i, h in enumerate(e.block_hashes):
                    if e.group_idx == FULL_GROUP:
                        assert h not in self.pages, "stored twice without a removal"
                        self.pages[h] = frozenset()
                        self.tokens[h] = e.token_ids[i * P : (i + 1) * P]
                        self.parents[h] = e.parent_block_hash if i == 0 else e.block_hashes[i - 1]
                    else:
                        assert e.group_idx is not None and e.kv_cache_spec_kind == "sliding_window"
                        assert e.group_idx not in self.pages[h], "window KV stored twice"
                        self.pages[h] |= {e.group_idx}
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    if e.group_idx == FULL_GROUP:
                        del self.pages[h]
                    else:
                        assert e.group_idx in self.pages[h], "window KV removed that was not live"
                        self.pages[h] -= {e.group_idx}
            else:
                assert isinstance(e, AllBlocksCleared)
                self.pages.clear()


def tree_state(cache: RadixCache, keys: list[list[int]]) -> dict[int, frozenset[int]]:
    """hash -> live window groups for every page the tree holds, named by hashing the keys that reach it."""
    out: dict[int, frozenset[int]] = {}
    stack = [cache.root]
    while stack:
        nd = stack.pop()
        for c in nd.children.values():
            for h in c.page_hashes:
                out[h] = frozenset(g for g in range(1, len(c.pages)) if c.pages[g] is not None)
            stack.append(c)
    # the names are the chained hashes of the inserted keys (not just whatever the tree stored)
    named = {h for k in keys for h in page_hashes(k, P)}
    assert set(out) <= named
    return out


@pytest.mark.parametrize("windows", [(9,), (6, 17)])
@pytest.mark.parametrize("window_aware", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_replayed_events_equal_the_tree_after_every_operation(
    seed: int, window_aware: bool, windows: tuple[int, ...]
) -> None:
    rng = random.Random(seed)
    pools = [PagePool(40, P, f"group{g}") for g in range(1 + len(windows))]
    cache = RadixCache(
        P, (None, *windows), [p.free for p in pools], window_aware=window_aware, record_events=True
    )
    replica = Replica()
    keys: list[list[int]] = []
    for _ in range(150):
        op = rng.random()
        if op < 0.55:
            # a key sharing a random prefix with an earlier one, so nodes split, heal and branch
            base = rng.choice(keys) if keys and rng.random() < 0.7 else []
            n = rng.randint(1, 6)
            cut = rng.randint(0, len(base) // P) * P
            key = base[:cut] + [rng.randint(0, 3) for _ in range(n * P)]
            pages = len(key) // P
            if any(pool.num_free < pages for pool in pools):
                cache.evict_full(pages)
            fp = pools[0].alloc(pages)
            if fp is None:
                continue
            rows = [fp]
            for pool in pools[1:]:
                live = [rng.random() < 0.8 for _ in range(pages)] if window_aware else [True] * pages
                row = []
                for alive in live:
                    got = pool.alloc(1) if alive else None
                    row.append(got[0] if got else NOT_RESIDENT)
                rows.append(row)
            res = cache.insert(key, *rows, tokens=[t + 100 for t in key])
            for pool, freed in zip(pools, res.to_free, strict=True):
                pool.free(freed)
            keys.append(key)
        elif op < 0.8:
            cache.evict_window(rng.randint(1, 6), rng.randrange(1, len(pools)))
        else:
            cache.evict_full(rng.randint(1, 6))
        replica.apply(cache.drain_events())
        assert replica.pages == tree_state(cache, keys)
        cache.check_integrity()
    assert cache.drain_events() == []
    # token rows and parents describe the chain: re-hashing a page's tokens from its parent gives its name
    for h, toks in replica.tokens.items():
        if h in replica.pages:
            parent = replica.parents[h]
            key = [t - 100 for t in toks]
            assert page_hashes(key, P, parent=parent or 0) == [h]


def test_no_events_unless_recording() -> None:
    full, swa = PagePool(8, P, "full"), PagePool(8, P, "swa")
    cache = RadixCache(P, (None, 9), (full.free, swa.free))
    fp = full.alloc(2)
    sp = swa.alloc(2)
    assert fp is not None and sp is not None
    cache.insert(list(range(8)), fp, sp)
    assert cache.drain_events() == []
    assert all(not n.page_hashes for n in cache._nodes.values())
