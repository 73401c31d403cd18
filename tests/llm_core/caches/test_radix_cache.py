"""SWA-aware radix prefix cache: hit rule, tombstones, eviction order, locks, healing."""

from __future__ import annotations

import pytest

from llm_core.caches.page_pool import PagePool
from llm_core.caches.radix_cache import NOT_RESIDENT, RadixCache

P = 4  # page size in tokens


def make_cache(
    window: int, window_aware: bool = True, pages: int = 64
) -> tuple[RadixCache, PagePool, PagePool]:
    full = PagePool(pages, P, "full")
    swa = PagePool(pages, P, "swa")
    return RadixCache(P, (None, window), (full.free, swa.free), window_aware=window_aware), full, swa


def key_of(*pages: int) -> list[int]:
    """A key whose page i is [pages[i]] * P: pages with equal labels share tokens."""
    return [t for label in pages for t in [label] * P]


def insert(cache: RadixCache, full: PagePool, swa: PagePool, key: list[int], live: list[bool]) -> None:
    """Insert ``key`` as a sequence would at finish: fresh full pages, SWA pages only where live."""
    n = len(key) // P
    fp = full.alloc(n)
    assert fp is not None
    sp = [swa.alloc(1)[0] if alive else NOT_RESIDENT for alive in live]  # type: ignore[index]
    res = cache.insert(key, fp, sp)
    full.free(res.full_to_free)
    swa.free(res.to_free[1])


def reference_hit(full_present: int, swa_live: list[bool], window: int, limit: int) -> int:
    """Longest page-aligned b <= limit with full KV for [0, b) and live SWA for [b-W+1, b)."""
    best = 0
    for pages in range(1, min(full_present, limit // P) + 1):
        b = pages * P
        lo = max(0, b - window + 1) // P
        if all(swa_live[lo:pages]):
            best = b
    return best


def test_full_live_prefix_hits_page_aligned() -> None:
    cache, full, swa = make_cache(window=9)
    insert(cache, full, swa, key_of(1, 2, 3), [True] * 3)
    assert cache.match_prefix(key_of(1, 2, 3)).length == 12
    assert cache.match_prefix(key_of(1, 2, 3)[:11]).length == 8  # the partial page never counts
    assert cache.match_prefix(key_of(1, 2, 9)).length == 8
    assert cache.match_prefix(key_of(7)).length == 0
    cache.check_integrity()


def test_tombstone_inside_window_breaks_hit() -> None:
    # W-1 = 8 tokens = 2 pages of SWA KV are needed before the hit boundary.
    cache, full, swa = make_cache(window=9)
    insert(cache, full, swa, key_of(1, 2, 3, 4), [True, False, True, True])
    # b = 12: window [4, 12) covers the tombstone on page 1 -> not a hit; b = 8 likewise;
    # b = 4: window clipped to [0, 4) which is live -> the hit falls back to 4.
    assert cache.match_prefix(key_of(1, 2, 3, 9)).length == 4
    # b = 16: window [8, 16) is pages 2-3, both live -> hit restored past the tombstone.
    assert cache.match_prefix(key_of(1, 2, 3, 4)).length == 16


def test_window_long_live_tail_after_tombstone_restores_hit() -> None:
    cache, full, swa = make_cache(window=9)
    # A long sequence whose early SWA pages left the window before it finished.
    insert(cache, full, swa, key_of(1, 2, 3, 4, 5, 6), [False] * 4 + [True] * 2)
    assert cache.match_prefix(key_of(1, 2, 3, 4, 5, 6)).length == 24
    # One live page short of the window: no boundary qualifies at all.
    assert cache.match_prefix(key_of(1, 2, 3, 4, 5)).length == 0
    hit = cache.match_prefix(key_of(1, 2, 3, 4, 5, 6))
    assert hit.pages[1][:4] == [NOT_RESIDENT] * 4 and NOT_RESIDENT not in hit.pages[1][4:]


def test_evicting_first_full_block_gives_no_hit() -> None:
    cache, full, swa = make_cache(window=9)
    insert(cache, full, swa, key_of(1, 2, 3), [True] * 3)
    insert(cache, full, swa, key_of(1, 5, 6), [True] * 3)
    # Full eviction goes leaf first; to lose page 0 (shared by both branches) all of it goes.
    cache.evict_full(5)
    assert cache.match_prefix(key_of(1, 2, 3)).length == 0
    assert cache.match_prefix(key_of(1, 5, 6)).length == 0
    assert full.num_used == 0 and swa.num_used == 0
    cache.check_integrity()


def test_hit_is_min_over_full_and_swa_valid_lengths() -> None:
    # Window of 1 page. The cached sequence [1, 2] has page 0 tombstoned and page 1 live.
    cache, full, swa = make_cache(window=5)
    insert(cache, full, swa, key_of(1, 2), [False, True])
    # For [1, 2] the SWA-valid lengths are {0, 8} and the full-valid ones {0, 4, 8}: hit 8.
    assert cache.match_prefix(key_of(1, 2)).length == 8
    # A request [1, 9]: full hit 1 page, the SWA hit of the cached path is 2 pages: the only common
    # valid length is 0, so it is a miss.
    assert cache.match_prefix(key_of(1, 9)).length == 0


def test_swa_eviction_tombstones_oldest_and_keeps_locked_window() -> None:
    cache, full, swa = make_cache(window=9)
    insert(cache, full, swa, key_of(1, 2, 3, 4), [True] * 4)
    hit = cache.match_prefix(key_of(1, 2, 3, 4))
    lock = cache.lock(hit.node)
    # Nothing is full-evictable while locked, but SWA outside the locked window is.
    assert cache.evictable_full_pages() == 0
    assert cache.evictable_window_pages(1) == 0  # one node: the window lock covers all of it
    cache.unlock(lock)
    insert(cache, full, swa, key_of(1, 2, 3, 4, 5, 6), [True] * 6)  # splits: [1..4] + [5, 6]
    hit = cache.match_prefix(key_of(1, 2, 3, 4, 5, 6))
    lock = cache.lock(hit.node)
    cache.check_integrity([lock])
    assert cache.evictable_window_pages(1) == 4  # pages 0-3 are outside the 2-page locked window
    freed = cache.evict_window(100, 1)
    # Trimmed to its window ([1, 2] tombstoned), then [3, 4] itself: two tombstones.
    assert freed == 4 and cache.num_tombstones() == 2
    assert cache.match_prefix(key_of(1, 2, 3, 4, 5, 6)).length == 24  # tail window still live
    assert cache.match_prefix(key_of(1, 2, 3, 4)).length == 0  # its window is now a tombstone
    cache.check_integrity([lock])
    cache.unlock(lock)
    cache.check_integrity([])


def test_swa_eviction_trims_to_the_boundary_window_first() -> None:
    cache, full, swa = make_cache(window=9)  # a boundary needs 2 pages of SWA
    insert(cache, full, swa, key_of(1, 2, 3, 4, 5, 6), [True] * 6)
    insert(cache, full, swa, key_of(7, 8), [True] * 2)  # more recent, exactly one window
    assert cache.evict_window(1, 1) == 4  # the old node's pages 0-3 serve no node boundary
    assert cache.match_prefix(key_of(1, 2, 3, 4, 5, 6)).length == 24  # its boundary still hits
    assert cache.match_prefix(key_of(7, 8)).length == 8
    assert cache.match_prefix(key_of(1, 2, 3, 9)).length == 0  # only a mid-node branch is lost
    assert swa.num_used == 4
    cache.check_integrity([])


def test_lock_survives_split_and_unlock_restores_counts() -> None:
    cache, full, swa = make_cache(window=9)
    insert(cache, full, swa, key_of(1, 2, 3, 4, 5), [True] * 5)
    lock = cache.lock(cache.match_prefix(key_of(1, 2, 3, 4, 5)).node)
    # A shorter match splits the locked node in the middle of the SWA-locked range.
    cache.match_prefix(key_of(1, 2, 3, 9))
    cache.match_prefix(key_of(1, 2, 3, 4, 9))
    cache.check_integrity([lock])
    cache.unlock(lock)
    cache.check_integrity([])
    assert cache.evictable_full_pages() == 5 and cache.evictable_window_pages(1) == 5


def test_tombstone_healed_by_recompute() -> None:
    cache, full, swa = make_cache(window=9)
    insert(cache, full, swa, key_of(1, 2, 3, 4), [False, False, True, True])
    assert cache.match_prefix(key_of(1, 2, 9)).length == 0
    used_full = full.num_used
    # A later request recomputed pages 0-2 and still holds their SWA KV (it finished early).
    insert(cache, full, swa, key_of(1, 2, 3), [True, True, True])
    assert full.num_used == used_full  # duplicate full pages were handed back
    assert cache.num_tombstones() == 0
    assert cache.match_prefix(key_of(1, 2, 9)).length == 8
    cache.check_integrity()


def test_partial_heal_splits_tombstone() -> None:
    cache, full, swa = make_cache(window=9)
    insert(cache, full, swa, key_of(1, 2, 3, 4), [False, False, False, True])
    insert(cache, full, swa, key_of(1, 2, 3), [False, True, True])
    assert cache.num_tombstones() == 1
    assert cache.match_prefix(key_of(1, 2, 3, 9)).length == 12
    cache.check_integrity()


def test_swa_unaware_mode_never_tombstones() -> None:
    cache, full, swa = make_cache(window=9, window_aware=False)
    insert(cache, full, swa, key_of(1, 2, 3), [True] * 3)
    insert(cache, full, swa, key_of(1, 2, 3, 4, 5), [True] * 5)
    lock = cache.lock(cache.match_prefix(key_of(1, 2, 3, 4, 5)).node)
    assert cache.evictable_window_pages(1) == 0  # every SWA page of a hit is in use
    assert cache.evict_window(10, 1) == 0 and cache.num_tombstones() == 0
    cache.unlock(lock)
    assert cache.evict_window(2, 1) == 2  # removes the leaf [4, 5] whole
    assert cache.match_prefix(key_of(1, 2, 3, 4, 5)).length == 12
    assert cache.num_tombstones() == 0
    cache.check_integrity([])


@pytest.mark.parametrize("window", [1, 4, 5, 9, 13])
def test_hit_matches_reference_on_all_liveness_patterns(window: int) -> None:
    n = 5
    for mask in range(1 << n):
        live = [bool(mask >> i & 1) for i in range(n)]
        cache, full, swa = make_cache(window=window)
        insert(cache, full, swa, key_of(*range(1, n + 1)), live)
        for limit_pages in range(n + 1):
            key = key_of(*range(1, limit_pages + 1)) + key_of(99)
            want = reference_hit(n, live, window, limit_pages * P)
            got = cache.match_prefix(key, touch=False)
            assert got.length == want, (live, limit_pages)
            lo = max(0, want - window + 1) // P
            assert all(p != NOT_RESIDENT for p in got.pages[1][lo:])
        cache.check_integrity()


def test_prefix_reuse_bench_quick_swa_aware_reuses_more() -> None:
    from bench import prefix_reuse

    summary = prefix_reuse.main(["--quick"])
    # At a budget where keep-all-SWA thrashes, the SWA-aware cache serves more of each prompt.
    assert summary["reuse_gain"] > 1.2  # type: ignore[operator]
