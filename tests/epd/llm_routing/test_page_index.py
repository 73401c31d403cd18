"""The router's page index against the engine's own prefix cache: fed the radix cache's KV events,
``EnginePageIndex.hit_tokens`` equals ``RadixCache.match_prefix(...).length`` for every probe after
every operation (inserts, locks, window trims and tombstones, full evictions, heals), with one
window group or two (windows 6 and 17), directly and through a real publisher and subscriber on
loopback. Plus the group rules and the approximate index."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest

from epd.llm_routing.kv_event_subscriber import KVEventSubscriber
from epd.llm_routing.llm_router import health_windows
from epd.llm_routing.page_index import ApproxPageIndex, EnginePageIndex
from epd_common.messages.kv_events import (
    FULL_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)
from epd_common.messages.page_hash import page_hashes
from llm_core.caches.page_pool import PagePool
from llm_core.caches.radix_cache import RadixCache
from llm_core.serving.kv_event_publisher import KVEventPublisher
from tests.epd.llm_routing.traces import P, Trace


def held_pages(index: EnginePageIndex) -> dict[int, int]:
    return index._pages


def windows_of(trace: Trace) -> tuple[int | None, ...]:
    if trace.window_aware:
        return trace.windows
    return tuple(None if w is None else (1 << 62) + 1 for w in trace.windows)  # unaware: the whole prefix


@pytest.mark.parametrize(
    ("window", "window_aware"), [(9, True), (6, True), (3, True), (1, True), (9, False), ((6, 17), True)]
)
@pytest.mark.parametrize("seed", range(4))
def test_index_fed_the_radix_events_hits_what_the_radix_hits(
    seed: int, window: int | tuple[int, ...], window_aware: bool
) -> None:
    trace = Trace(seed, window, window_aware)
    index = EnginePageIndex(P, windows_of(trace))
    index.apply(KVEventBatch(0.0, (AllBlocksCleared(),)))  # the engine's first batch
    nonzero = 0
    seen: set[str] = set()
    for _ in range(120):
        trace.step()
        events = trace.cache.drain_events()
        for e in events:
            group = getattr(e, "group_idx", None)
            healed = (
                isinstance(e, BlockStored) and group != FULL_GROUP and e.block_hashes[0] in held_pages(index)
            )
            seen.add(f"{type(e).__name__}/{group}" + ("/heal" if healed else ""))
        index.apply(KVEventBatch(0.0, tuple(events)))
        trace.cache.check_integrity(trace.locks)
        for key in trace.probes():
            want = trace.expected(key)
            assert index.hit_tokens(page_hashes(key, P), len(key) - 1) == want, key
            nonzero += want > 0
    assert nonzero > 100  # the trace reached states with hits, not just an empty tree
    # every kind of change happened: new pages, window drops, removals (and heals where a window matters)
    kinds = {"BlockStored/0", "BlockRemoved/0"}
    for g, w in enumerate(trace.windows):
        if window_aware and w is not None and w > 1:
            kinds |= {f"BlockStored/{g}", f"BlockRemoved/{g}", f"BlockStored/{g}/heal"}
    assert kinds <= seen, seen
    # every page the index holds is one the tree holds
    held = {h for nd in trace.cache._nodes.values() for h in nd.page_hashes}
    assert len(index) == len(held)


def test_index_through_a_real_publisher_and_subscriber() -> None:
    trace = Trace(11, 9)
    index = EnginePageIndex(P, trace.windows)
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    applied: list[int] = []
    done = threading.Event()

    def on_batch(seq: int, batch: KVEventBatch) -> None:
        index.apply(batch)
        applied.append(seq)
        done.set()

    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint, on_batch, on_reset=index.clear)
    sub.start()
    try:
        pub.publish(KVEventBatch(time.time(), (AllBlocksCleared(),)))
        published = 1
        for _ in range(60):
            trace.step()
            events = trace.cache.drain_events()
            if not events:
                continue
            pub.publish(KVEventBatch(time.time(), tuple(events)))
            published += 1
            deadline = time.monotonic() + 2
            while len(applied) < published and time.monotonic() < deadline:
                time.sleep(0.002)
            assert applied == list(range(published))
            for key in trace.probes():
                assert index.hit_tokens(page_hashes(key, P), len(key) - 1) == trace.expected(key)
        assert published > 20
    finally:
        sub.stop()
        pub.close()
    assert not sub.alive


def stored(hashes: tuple[int, ...], group: int | None, kind: str | None = None) -> BlockStored:
    return BlockStored(hashes, None, (0,) * (len(hashes) * P), P, group_idx=group, kv_cache_spec_kind=kind)


def test_group_rules() -> None:
    key = list(range(5 * P))
    h = tuple(page_hashes(key, P))
    index = EnginePageIndex(P, (None, 2 * P + 1))  # W-1 = 2 pages
    index.apply(KVEventBatch(0.0, (stored(h, FULL_GROUP, "full_attention"),)))
    assert index.hit_tokens(h, 5 * P) == 0  # full KV alone: no window is live
    index.apply(KVEventBatch(0.0, (stored(h[2:4], 1, "sliding_window"),)))
    assert index.hit_tokens(h, 5 * P) == 4 * P  # window [2, 4) live
    assert index.hit_tokens(h, 4 * P - 1) == 0  # the boundary at 4 is past max_tokens
    index.apply(KVEventBatch(0.0, (BlockRemoved(h[3:4], group_idx=1),)))
    assert index.hit_tokens(h, 5 * P) == 0
    index.apply(KVEventBatch(0.0, (stored(h[:2], 1, "sliding_window"),)))
    assert index.hit_tokens(h, 5 * P) == 3 * P  # window live on pages 0-2: b = 3, window [1, 3)
    # the previous release's name for a window group's removal still reads as one
    legacy = {
        "ts": 0.0,
        "events": [{"type": "SwaTombstoned", "block_hashes": [h[1]], "medium": "CPU", "group_idx": 1}],
    }
    index.apply(decode_batch(msgpack.packb(legacy)))
    assert index.hit_tokens(h, 5 * P) == P  # live 0, 2: only b = 1 (window clipped to [0, 1))
    assert len(index) == 5  # a group-1 removal drops that group's state only; the full KV stays
    index.apply(
        KVEventBatch(0.0, (stored(h[1:2], 1, "sliding_window"), BlockRemoved(h[1:], group_idx=FULL_GROUP)))
    )
    assert index.hit_tokens(h, 5 * P) == P and len(index) == 1  # only page 0 is left
    index.apply(KVEventBatch(0.0, (stored(h[1:2], FULL_GROUP, "full_attention"),)))
    index.apply(KVEventBatch(0.0, (AllBlocksCleared(),)))
    assert len(index) == 0


def test_events_without_a_group_are_full_and_live() -> None:
    # a vLLM engine serving a model without SWA layers: no group, or a group this index does not know
    h = tuple(page_hashes(list(range(3 * P)), P))
    index = EnginePageIndex(P)
    index.apply(KVEventBatch(0.0, (stored(h[:2], None, "full_attention"), stored(h[2:], 7))))
    assert index.hit_tokens(h, 3 * P) == 3 * P
    index.apply(KVEventBatch(0.0, (BlockRemoved(h[1:2]),)))  # no group: the page is gone
    assert index.hit_tokens(h, 3 * P) == P
    windowed = EnginePageIndex(P, (None, 2 * P + 1))
    windowed.apply(KVEventBatch(0.0, (stored(h, None, "full_attention"),)))
    assert windowed.hit_tokens(h, 3 * P) == 3 * P


def test_chained_names_stop_the_walk_at_the_first_missing_page() -> None:
    a = page_hashes([1] * P + [2] * P, P)
    b = page_hashes([9] * P + [2] * P, P)  # page 1 has the same tokens but another prefix
    index = EnginePageIndex(P)
    index.apply(KVEventBatch(0.0, (stored(tuple(a), FULL_GROUP), stored((b[1],), FULL_GROUP))))
    assert index.hit_tokens(b, 2 * P) == 0
    assert index.hit_tokens(a, 2 * P) == 2 * P


def test_approx_index_forgets_after_the_ttl_and_refreshes_on_record() -> None:
    now = [100.0]
    index = ApproxPageIndex(P, ttl_s=10.0, clock=lambda: now[0])
    h = page_hashes(list(range(4 * P)), P)
    index.record(h[:3])
    assert index.hit_tokens(h, 4 * P) == 3 * P
    assert index.hit_tokens(h, 2 * P + 1) == 2 * P
    now[0] = 105.0
    index.record(h[:1])  # refreshed: page 0 lives until 115
    now[0] = 110.0
    assert index.hit_tokens(h, 4 * P) == P
    assert len(index) == 1  # the expired pages were dropped, not just hidden
    now[0] = 115.0
    assert index.hit_tokens(h, 4 * P) == 0 and len(index) == 0


def test_invalid_geometry_is_refused() -> None:
    with pytest.raises(ValueError, match="page_size"):
        EnginePageIndex(0, (None, 4))
    with pytest.raises(ValueError, match="group 0 full attention"):
        EnginePageIndex(P, (4,))
    with pytest.raises(ValueError, match="ttl_s"):
        ApproxPageIndex(P, ttl_s=0)


def test_full_attention_engine_events_predict_its_hits() -> None:
    """A full-attention engine (one KV group) publishes group-0 events only; the router, told by
    /health that the engine has no window group, predicts exactly the tree's hits."""
    pool = PagePool(64, P, "full")
    tree = RadixCache(P, (None,), (pool.free,), record_events=True)
    windows = health_windows({"kv_groups": [{"group": 0, "kind": "full_attention", "sliding_window": None}]})
    assert windows == (None,)
    index = EnginePageIndex(P, windows)
    keys = [list(range(24)), [*range(12), *range(50, 62)], list(range(100, 108))]
    for key in keys:
        pages = pool.alloc(len(key) // P)
        assert pages is not None
        pool.free(tree.insert(key, pages).to_free[0])
    tree.evict_full(2)
    batch = KVEventBatch(time.time(), tuple(tree.drain_events()))
    assert all(getattr(e, "group_idx", 0) in (0, None) for e in batch.events)
    index.apply(batch)
    for key in [*keys, list(range(20)), [*range(12), 7, 7, 7, 7, 7]]:
        want = tree.match_prefix(key, len(key) - 1, touch=False).length
        assert index.hit_tokens(page_hashes(key[: (len(key) - 1) // P * P], P), len(key) - 1) == want
