"""vLLM's page naming without vLLM (``epd/llm_routing/vllm_block_hash.py``; its hashes against
vLLM's own code: ``test_vllm_block_hash.py``) and the router's gate on a naming's check."""

from __future__ import annotations

import time
from collections.abc import Callable

from epd.llm_routing.kv_event_subscriber import SubscriberCounters
from epd.llm_routing.llm_router import LLMRouter
from epd.llm_routing.page_naming import RoutingPrompt
from epd.llm_routing.vllm_block_hash import SCHEME, VLLMBlockNaming, full_block_hashes, media_ranges
from epd_common.messages.cache_keys import MediaSpan
from epd_common.messages.kv_events import BlockStored, KVEventBatch, external_hash


def test_a_media_item_split_over_runs_is_one_range() -> None:
    """A MiMo-V2.5 video takes several placeholder runs: vLLM places it as one item, from its
    first pad to its last."""
    spans = [MediaSpan(3, 4, "v", 0, 0), MediaSpan(9, 4, "v", 0, 4), MediaSpan(20, 2, "i", 1)]
    assert [tuple(r) for r in media_ranges(spans)] == [(3, 10, "v"), (20, 2, "i")]


def test_the_recipe_is_checked_on_a_stored_root() -> None:
    """A root event whose hashes come from the recipe passes the check; one hashed with another
    seed fails, with the flags to fix it named; an event with a parent cannot tell."""
    ids = list(range(100, 108))
    ranges = media_ranges([MediaSpan(2, 3, "key-a", 0)])
    good = [external_hash(h) for h in full_block_hashes(ids, ranges, 4)]
    extra = ((("key-a", 2),), (("key-a", -2),))
    event = BlockStored(tuple(good), None, tuple(ids), 4, extra_keys=extra)
    naming = VLLMBlockNaming()
    assert naming.check(event).ok is True
    other = [external_hash(h) for h in full_block_hashes(ids, ranges, 4, seed="1234")]
    verdict = naming.check(BlockStored(tuple(other), None, tuple(ids), 4, extra_keys=extra))
    assert verdict.ok is False and "sha256_cbor" in verdict.detail
    assert naming.check(BlockStored(tuple(good[1:]), good[0], tuple(ids[4:]), 4)).ok is None


class _Source:
    """An event source the test feeds by hand (the subscriber's ZMQ side is tested on its own)."""

    def __init__(self, on_batch: Callable[[int, KVEventBatch], None], on_reset: Callable[[], None]) -> None:
        self.apply, self.on_reset = on_batch, on_reset
        self.batches = self.resyncs = 0

    def on_batch(self, seq: int, batch: KVEventBatch) -> None:
        self.batches += 1
        self.apply(seq, batch)

    def start(self) -> None: ...
    def stop(self, timeout_s: float = 1.0) -> None: ...
    def resync(self) -> None:
        self.resyncs += 1
        self.on_reset()

    def counters(self) -> SubscriberCounters:
        return SubscriberCounters(self.batches, 0, 0, self.resyncs, 0, 0)


def _router(sources: dict[str, _Source], clock: Callable[[], float] = time.monotonic) -> LLMRouter:
    def factory(
        endpoint: str,
        replay: object,
        topic: str,
        on_batch: Callable[[int, KVEventBatch], None],
        on_reset: Callable[[], None],
    ) -> _Source:
        assert topic == ""
        sources[endpoint] = _Source(on_batch, on_reset)
        return sources[endpoint]

    router = LLMRouter(["http://a", "http://b"], subscriber_factory=factory, clock=clock)
    for url in ("http://a", "http://b"):
        router.set_live(url, True)
        router.on_health(url, _health(url))
    return router


def _health(url: str) -> dict[str, object]:
    return {
        "page_size": 4,
        "page_naming": SCHEME,
        "kv_events_endpoint": f"tcp://{url[7:]}:1",
        "kv_events_topic": "",
    }


def _stored(ids: list[int], seed: str = "vllm-none-hash") -> KVEventBatch:
    hashes = [external_hash(h) for h in full_block_hashes(ids, [], 4, seed=seed)]
    return KVEventBatch(time.time(), (BlockStored(tuple(hashes), None, tuple(ids), 4),))


def test_an_index_is_read_only_once_the_servers_events_confirm_its_naming() -> None:
    sources: dict[str, _Source] = {}
    router = _router(sources)
    ids = list(range(1000, 1016))
    prompt = RoutingPrompt([*ids, 1])
    # b's events name blocks with another seed: its hits are never predicted
    sources["tcp://b:1"].on_batch(0, _stored(ids, seed="42"))
    rows = {e.url: e for e in router.stats().engines}
    assert rows["http://b"].naming_check.startswith("mismatch") and rows["http://a"].naming_check == "pending"
    d = router.route(prompt, 17, 4, "r0", among=["http://b"])
    assert d.predicted_cached_tokens == 0
    d.finish()
    sources["tcp://a:1"].on_batch(0, _stored(ids))
    assert {e.url: e.naming_check for e in router.stats().engines}["http://a"] == "ok"
    d = router.route(prompt, 17, 4, "r1")
    assert (d.url, d.predicted_cached_tokens) == ("http://a", 16)
    d.finish()


def test_a_server_of_another_block_size_is_routed_by_load() -> None:
    sources: dict[str, _Source] = {}
    router = _router(sources)
    ids = list(range(16))
    hashes = [external_hash(h) for h in full_block_hashes(ids, [], 16)]
    sources["tcp://a:1"].on_batch(0, KVEventBatch(0.0, (BlockStored(tuple(hashes), None, tuple(ids), 16),)))
    row = {e.url: e for e in router.stats().engines}["http://a"]
    assert "16 tokens" in row.naming_check and "the router's 4" in row.naming_check


def test_a_stream_that_stops_while_requests_flow_is_dropped_until_it_moves_again() -> None:
    now = [0.0]
    sources: dict[str, _Source] = {}
    router = _router(sources, clock=lambda: now[0])
    ids = list(range(1000, 1016))
    prompt = RoutingPrompt([*ids, 1])
    sources["tcp://a:1"].on_batch(0, _stored(ids))
    router.on_health("http://a", _health("http://a"))
    for i in range(8):  # requests flow, the stream says nothing
        router.route(prompt, 17, 4, f"r{i}", among=["http://a"]).finish()
    now[0] = 5.0
    router.on_health("http://a", _health("http://a"))
    assert {e.url: e.naming_check for e in router.stats().engines}["http://a"] == "ok"  # not long enough
    now[0] = 11.0
    router.on_health("http://a", _health("http://a"))
    row = {e.url: e for e in router.stats().engines}["http://a"]
    assert row.naming_check.startswith("stale") and row.index_pages == 0 and sources["tcp://a:1"].resyncs == 1
    assert router.route(prompt, 17, 4, "r9", among=["http://a"]).predicted_cached_tokens == 0
    sources["tcp://a:1"].on_batch(1, _stored(ids))  # the publisher answers again
    router.on_health("http://a", _health("http://a"))
    assert router.route(prompt, 17, 4, "r10", among=["http://a"]).predicted_cached_tokens == 16
