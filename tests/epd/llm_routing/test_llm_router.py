"""The router over fake engines (a real KVManager + RadixCache each, its KV events fed to the
router): predicted hits equal the engines' own, follow-up turns find their engine, and the four
failure modes of cache-aware routers stay fixed: a miss piling onto the overloaded engine, a lost
decrement, a health check resetting counters, all-tie requests all going to engine 0."""

from __future__ import annotations

import itertools
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from epd.llm_routing import page_naming
from epd.llm_routing.kv_event_subscriber import SubscriberCounters
from epd.llm_routing.llm_router import LLMRouter, NoEngineAvailable, connect_address, health_windows
from epd.llm_routing.load_counters import Dispatch
from epd.llm_routing.policy import RouterConfig
from epd_common.messages.kv_events import AllBlocksCleared, KVEventBatch
from llm_core.caches.kv_group_manager import FullAttentionManager, SlidingWindowManager
from llm_core.caches.kv_manager import KVManager
from llm_core.caches.page_pool import PagePool
from llm_core.request import Sequence
from llm_core.serving.kv_event_publisher import KVEventPublisher

P = 4
WINDOW = 9


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeSource:
    """Stands in for the ZMQ subscriber: the test hands it the engine's batches."""

    def __init__(
        self,
        endpoint: str,
        replay: str | None,
        on_batch: Callable[[int, KVEventBatch], None],
        on_reset: Callable[[], None],
    ) -> None:
        self.endpoint = endpoint
        self.on_batch = on_batch
        self.on_reset = on_reset
        self.started = self.stopped = False
        self.resyncs = 0
        self.seq = 0

    def start(self) -> None:
        self.started = True

    def stop(self, timeout_s: float = 1.0) -> None:
        self.stopped = True

    def resync(self) -> None:
        self.resyncs += 1
        self.on_reset()

    def counters(self) -> SubscriberCounters:
        return SubscriberCounters(self.seq, 0, 0, self.resyncs, 0, 0)

    def feed(self, batch: KVEventBatch) -> None:
        self.on_batch(self.seq, batch)
        self.seq += 1


class FakeEngine:
    """The engine's KV side only: a request is matched, prefilled, decoded and released into the
    prefix cache exactly as the scheduler would do it, without a model."""

    def __init__(self, url: str, pages: int = 256, page_size: int = P, events: bool = True) -> None:
        self.url = url
        self.page_size = page_size
        self.kv = KVManager(
            [
                FullAttentionManager(PagePool(pages, page_size, "full")),
                SlidingWindowManager(PagePool(pages, page_size, "swa"), WINDOW),
            ],
            record_events=True,
        )
        self.events = events
        self.instance_id = f"{url}#1"
        self.held: list[str] = []
        self._rng = random.Random(url)

    def run(self, rid: str, prompt: list[int], n_out: int) -> tuple[int, list[int]]:
        """Serve one request; returns (cached prompt tokens, the generated tokens)."""
        seq = Sequence(rid, list(prompt), max_new_tokens=n_out)
        hit = self.kv.match_prefix(seq)
        todo = len(prompt) - hit
        assert self.kv.allocate(seq, todo)
        self.kv.commit(seq, todo)
        out: list[int] = []
        for _ in range(n_out):
            token = self._rng.randint(0, 50)
            seq.output_ids.append(token)
            out.append(token)
            assert self.kv.allocate(seq, 1)
            self.kv.commit(seq, 1)
        self.kv.release(seq)
        return hit, out

    def drain(self) -> KVEventBatch:
        assert self.kv.radix is not None
        return KVEventBatch(time.time(), tuple(self.kv.radix.drain_events()))

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "page_size": self.page_size,
            "kv_groups": groups_health(WINDOW),
            "kv_events_endpoint": f"fake://{self.url}" if self.events else None,
            "kv_events_replay_endpoint": None,
            "instance_id": self.instance_id,
            "request_ids": list(self.held),
            "num_prefill_tokens": 0,
            "num_decode_tokens": 0,
        }


class Cluster:
    def __init__(self, n: int, config: RouterConfig | None = None, events: bool = True, **kw: Any) -> None:
        self.clock = Clock()
        self.engines = {f"http://e{i}": FakeEngine(f"http://e{i}", events=events, **kw) for i in range(n)}
        self.sources: dict[str, FakeSource] = {}
        self.router = LLMRouter(list(self.engines), config, clock=self.clock, subscriber_factory=self._source)
        for url in self.engines:
            self.health(url)
        self.router.start()
        self._ids = itertools.count()

    def _source(
        self, endpoint: str, replay: str | None, topic: str, on_batch: Any, on_reset: Any
    ) -> FakeSource:
        src = FakeSource(endpoint, replay, on_batch, on_reset)
        self.sources[endpoint.removeprefix("fake://")] = src
        return src

    def health(self, url: str) -> None:
        self.router.on_health(url, self.engines[url].health())

    def route(self, prompt: list[int], n_out: int = 6) -> Dispatch:
        return self.router.route(prompt, len(prompt), n_out, f"r{next(self._ids)}")

    def serve(self, d: Dispatch, prompt: list[int]) -> tuple[int, list[int]]:
        """Run a routed request on its engine, feed the engine's events, finish: (cached, output)."""
        engine = self.engines[d.url]
        with d:
            d.first_token()
            actual, out = engine.run(d.request_id, prompt, d.max_tokens)
            d.add_output_tokens(len(out))
        self.router.record_actual(d, actual)
        if engine.events:
            self.sources[d.url].feed(engine.drain())
        return actual, out

    def request(self, prompt: list[int], n_out: int = 6) -> tuple[str, int, list[int]]:
        """Route, serve and check the prediction: (url, predicted, output)."""
        d = self.route(prompt, n_out)
        actual, out = self.serve(d, prompt)
        assert d.predicted_cached_tokens == actual, (d.url, d.predicted_cached_tokens, actual)
        return d.url, d.predicted_cached_tokens, out


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(100, 10_000) for _ in range(n)]


def groups_health(window: int) -> list[dict[str, Any]]:
    """/health's ``kv_groups`` of a model with one window (what the router reads of them)."""
    return [
        {"group": 0, "kind": "full_attention", "sliding_window": None},
        {"group": 1, "kind": "sliding_window", "sliding_window": window},
    ]


def test_follow_up_turns_go_to_the_engine_holding_their_prefix_and_hits_are_predicted_exactly() -> None:
    c = Cluster(3)
    rng = random.Random(0)
    system = tokens(rng, 24)  # a shared system prompt: every engine may end up with it
    convs: dict[int, tuple[list[int], str | None]] = {i: (system + tokens(rng, 10), None) for i in range(12)}
    follow_ups = hits = 0
    for _ in range(5):  # turns
        for i in rng.sample(list(convs), len(convs)):
            prompt, home = convs[i]
            url, predicted, out = c.request(prompt)
            if home is not None:
                follow_ups += 1
                hits += predicted > len(prompt) // 2
                assert url == home, f"conversation {i} left {home} for {url}"
            convs[i] = (prompt + out + tokens(rng, rng.randint(3, 9)), url)
    assert follow_ups == 48 and hits == follow_ups
    st = c.router.stats()
    assert st.predicted_cached_tokens == st.actual_cached_tokens > 0  # no drift
    assert sum(e.abs_error_tokens for e in st.engines) == 0
    # (one request at a time leaves no load: every new conversation goes where the system prompt
    # is cached, by design; the concurrent test below is the one that spreads)


def test_concurrent_conversations_spread_and_come_back_home() -> None:
    c = Cluster(3)
    rng = random.Random(7)
    system = tokens(rng, 24)
    convs = {i: system + tokens(rng, 12) for i in range(12)}
    home: dict[int, str] = {}
    went_home = follow_ups = 0
    for _ in range(4):
        # a turn of every conversation is in flight at once: each one's load steers the next
        routed = {i: c.route(prompt) for i, prompt in convs.items()}
        for i, d in routed.items():
            if i in home:
                follow_ups += 1
                went_home += d.url == home[i]
            home[i] = d.url
        for i, d in routed.items():
            actual, out = c.serve(d, convs[i])
            assert d.predicted_cached_tokens <= actual  # an earlier request of the turn may add hits
            convs[i] = convs[i] + out + tokens(rng, rng.randint(3, 9))
    assert len(set(home.values())) == 3
    assert went_home >= 0.9 * follow_ups, (went_home, follow_ups)


def test_a_miss_never_piles_onto_the_overloaded_engine() -> None:
    c = Cluster(3, RouterConfig(balance_abs_tokens=64, balance_rel=1.5))
    rng = random.Random(1)
    shared = tokens(rng, 40)
    hot, _, _ = c.request(shared + tokens(rng, 5))  # ``hot`` now holds the shared prefix
    others = [u for u in c.engines if u != hot]
    for u in others:
        c.router.set_live(u, False)
    stuck = [c.router.route(tokens(rng, 200), 200, 16, f"stuck{i}") for i in range(3)]  # never finished
    assert {d.url for d in stuck} == {hot}
    for u in others:
        c.router.set_live(u, True)
    misses = [c.router.route(tokens(rng, 30), 30, 8, f"m{i}") for i in range(30)]  # nor these
    assert hot not in {d.url for d in misses}
    # a prompt whose prefix only the hot engine holds is recomputed elsewhere
    d = c.router.route(shared + tokens(rng, 5), 45, 8, "h")
    assert d.url != hot and d.predicted_cached_tokens == 0


def test_the_guard_keeps_affinity_while_the_imbalance_is_small() -> None:
    c = Cluster(2, RouterConfig(balance_abs_tokens=10_000))
    rng = random.Random(2)
    prompt = tokens(rng, 80)
    url, _, out = c.request(prompt)
    c.router._engines[url].load.dispatch("busy", 60, 0, 16)  # loaded, but within both margins
    d = c.router.route(prompt + out + tokens(rng, 4), 90, 8, "next")
    assert d.url == url and d.predicted_cached_tokens > 0


def test_a_lost_decrement_is_corrected_from_the_engines_report_after_the_grace() -> None:
    c = Cluster(2, RouterConfig(reconcile_grace_s=2.0))
    url = "http://e0"
    c.router.set_live("http://e1", False)
    lost = c.router.route(list(range(100)), 100, 8, "lost")  # its finish never comes
    kept = c.router.route(list(range(50)), 50, 8, "kept")
    c.engines[url].held = ["kept"]
    c.clock.now += 1.0
    c.health(url)  # within the grace: the engine may not have it yet
    assert c.router.stats().engines[0].load.inflight == 2
    c.clock.now += 1.5
    c.health(url)
    load = c.router.stats().engines[0].load
    assert (load.inflight, load.prefill_tokens, load.corrected) == (1, 50, 1)
    lost.finish()  # arrives late after all: not counted twice
    kept.finish()
    assert c.router.stats().engines[0].load.prefill_tokens == 0


def test_a_health_check_never_resets_the_counters() -> None:
    c = Cluster(2)
    ds = [c.router.route(list(range(i, i + 40)), 40, 8, f"r{i}") for i in range(6)]
    for e in c.engines.values():
        e.held = [d.request_id for d in ds]
    before = c.router.stats().engines
    for _ in range(3):
        c.clock.now += 10
        for url in c.engines:
            c.health(url)
    assert [e.load for e in c.router.stats().engines] == [e.load for e in before]
    # a restart clears what the engine cached (new instance id), not the router's counters
    c.engines["http://e0"].instance_id = "http://e0#2"
    c.health("http://e0")
    assert c.sources["http://e0"].resyncs == 1
    assert [e.load for e in c.router.stats().engines] == [e.load for e in before]
    for d in ds:
        d.finish()


def test_all_tie_requests_spread_over_the_engines() -> None:
    for policy in ("affinity", "least_load"):
        c = Cluster(4, RouterConfig(policy=policy, seed=3))  # type: ignore[arg-type]
        rng = random.Random(4)
        picks = Counter(c.request(tokens(rng, 20), 2)[0] for _ in range(200))
        assert len(picks) == 4 and min(picks.values()) > 25, (policy, picks)


def test_round_robin_cycles_over_live_engines() -> None:
    c = Cluster(3, RouterConfig(policy="round_robin"))
    c.router.set_live("http://e1", False)
    picks = [c.router.route([1, 2, 3], 3, 1, f"r{i}").url for i in range(4)]
    assert picks == ["http://e0", "http://e2", "http://e0", "http://e2"]


def test_approximate_mode_sends_a_repeat_to_the_same_engine_and_forgets_after_the_ttl() -> None:
    c = Cluster(3, RouterConfig(approx_ttl_s=60.0), events=False)
    assert {e.mode for e in c.router.stats().engines} == {"approximate"}
    rng = random.Random(5)
    prompt = tokens(rng, 41)
    first = c.router.route(prompt, 41, 8, "a")
    first.finish()
    assert first.predicted_cached_tokens == 0
    for i in range(5):
        c.clock.now += 30  # each repeat refreshes the TTL
        again = c.router.route(prompt, 41, 8, f"b{i}")
        again.finish()
        assert again.url == first.url and again.predicted_cached_tokens == 40
    c.clock.now += 61
    later = c.router.route([*prompt, 7], 42, 8, "c")
    assert later.predicted_cached_tokens == 0  # forgotten
    assert c.router.stats().engines[list(c.engines).index(first.url)].index_pages == 10  # re-recorded


def test_down_engines_are_skipped_and_all_down_is_a_clear_error() -> None:
    c = Cluster(2)
    c.router.set_live("http://e0", False)
    assert {c.router.route([1, 2], 2, 1, f"r{i}").url for i in range(10)} == {"http://e1"}
    c.router.set_live("http://e1", False)
    with pytest.raises(NoEngineAvailable, match="all 2 LLM engines are down"):
        c.router.route([1, 2], 2, 1, "x")
    with pytest.raises(KeyError, match="not one of the router's engines"):
        c.router.set_live("http://nope", True)


def test_page_hashes_are_computed_once_per_page_size(monkeypatch: pytest.MonkeyPatch) -> None:
    c = Cluster(2)
    c.engines["http://e2"] = FakeEngine("http://e2", page_size=8)
    router = LLMRouter(list(c.engines), clock=c.clock, subscriber_factory=c._source)
    for url in c.engines:
        router.on_health(url, c.engines[url].health())
    calls: list[int] = []
    real = page_naming.page_hashes

    def counting(keys: list[int], page_size: int) -> list[int]:
        calls.append(page_size)
        return real(keys, page_size)

    monkeypatch.setattr(page_naming, "page_hashes", counting)
    router.route(list(range(30)), 30, 4, "r").finish()
    assert sorted(calls) == [4, 8]


def test_stats_report_load_spread_and_drift() -> None:
    c = Cluster(2)
    c.router.set_live("http://e1", False)
    d = c.router.route(list(range(40)), 40, 8, "r")
    c.router.set_live("http://e1", True)
    st = c.router.stats()
    assert st.load_spread == 2.0  # one engine holds all: max / mean = 2 over two
    assert st.engines[0].load.prefill_tokens == 40 and st.engines[0].mode == "events"
    c.router.record_actual(d, 16)
    st = c.router.stats()
    assert (st.predicted_cached_tokens, st.actual_cached_tokens, st.engines[0].abs_error_tokens) == (
        0,
        16,
        16,
    )
    d.finish()
    assert c.router.stats().load_spread == 1.0


def test_a_new_events_endpoint_replaces_the_subscriber() -> None:
    c = Cluster(1)
    old = c.sources["http://e0"]
    assert old.started
    health = c.engines["http://e0"].health()
    c.router.on_health("http://e0", {**health, "kv_events_endpoint": "fake://http://e0-b"})
    assert old.stopped and c.sources["http://e0-b"].started
    c.router.on_health("http://e0", {**health, "kv_events_endpoint": None})
    assert c.sources["http://e0-b"].stopped and c.router.stats().engines[0].mode == "approximate"
    c.router.close()


def test_connect_address_replaces_a_wildcard_host() -> None:
    assert connect_address("tcp://*:5557", "http://10.0.0.7:8001") == "tcp://10.0.0.7:5557"
    assert connect_address("tcp://0.0.0.0:5557", "http://host-a:8001/") == "tcp://host-a:5557"
    assert connect_address("tcp://127.0.0.1:5557", "http://host-a:8001") == "tcp://127.0.0.1:5557"
    assert connect_address("ipc:///tmp/kv", "http://host-a:8001") == "ipc:///tmp/kv"


@pytest.fixture
def published_engine() -> Iterator[tuple[FakeEngine, KVEventPublisher]]:
    engine = FakeEngine("http://127.0.0.1:1")
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    pub.publish(KVEventBatch(time.time(), (AllBlocksCleared(),)))
    yield engine, pub
    pub.close()


def test_the_router_follows_a_real_publisher(published_engine: tuple[FakeEngine, KVEventPublisher]) -> None:
    engine, pub = published_engine
    other = "http://127.0.0.1:2"
    router = LLMRouter([engine.url, other])
    router.start()
    try:
        router.on_health(
            engine.url,
            {
                **engine.health(),
                "kv_events_endpoint": pub.endpoint,
                "kv_events_replay_endpoint": pub.replay_endpoint,
            },
        )
        router.set_live(other, False)
        rng = random.Random(6)
        prompt = tokens(rng, 37)
        d = router.route(prompt, len(prompt), 4, "r0")
        _, out = engine.run("r0", prompt, 4)
        d.finish()
        pub.publish(engine.drain())
        follow = prompt + out + tokens(rng, 5)
        deadline = time.monotonic() + 3
        while router.stats().engines[0].index_pages == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        router.set_live(other, True)
        d2 = router.route(follow, len(follow), 4, "r1")
        hit, _ = engine.run("r1", follow, 4)
        assert d2.url == engine.url and d2.predicted_cached_tokens == hit > 0
        events = router.stats().engines[0].events
        assert events is not None and events.batches == 2
    finally:
        router.close()


def test_an_approximate_index_is_kept_across_health_reports_and_rebuilt_for_a_new_page_size() -> None:
    c = Cluster(1, events=False)
    c.router.route(list(range(40)), 40, 4, "r").finish()
    assert c.router.stats().engines[0].index_pages == 10
    c.router.on_health("http://e0", {**c.engines["http://e0"].health(), "kv_groups": groups_health(33)})
    assert c.router.stats().engines[0].index_pages == 10  # no window applies without events
    c.router.on_health("http://e0", {**c.engines["http://e0"].health(), "page_size": 8})
    st = c.router.stats().engines[0]
    assert (st.index_pages, st.page_size) == (0, 8)


def test_external_load_steers_only_when_configured() -> None:
    for counted in (False, True):
        c = Cluster(2, RouterConfig(count_external_load=counted, seed=1))
        busy = {**c.engines["http://e0"].health(), "num_prefill_tokens": 5000, "num_decode_tokens": 900}
        c.router.on_health("http://e0", busy)  # another ingress keeps e0 busy
        assert c.router.stats().engines[0].load.external_prefill_tokens == 5000
        picks = Counter(c.router.route(list(range(i, i + 20)), 20, 4, f"r{i}").url for i in range(40))
        if counted:
            assert set(picks) == {"http://e1"}
        else:
            assert len(picks) == 2


def test_health_windows_reads_the_engine_kv_groups() -> None:
    full = {"group": 0, "kind": "full_attention", "sliding_window": None}
    narrow = {"group": 1, "kind": "sliding_window", "sliding_window": 6}
    wide = {"group": 2, "kind": "sliding_window", "sliding_window": 17}
    # a full-attention engine has no window rule (its events name group 0 only)
    assert health_windows({"kv_groups": [full]}) == (None,)
    # every window group in group order, whatever order /health lists them in
    assert health_windows({"kv_groups": [wide, full, narrow]}) == (None, 6, 17)
    assert health_windows({"sliding_window": 64}) == (None, 64)  # the previous release's engine
    assert health_windows({}) is None
