"""The store tier under the host tier, on a real redis-server: a session whose KV one engine
evicted returns on another engine (or the same one, after its host tier dropped the pages) with the
greedy ids of the same session recomputed, an image in its history; a corrupted value, a stopped
and a killed server, and a store slower than recomputing all end in the recomputed ids."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import redis

from epd_common.store.guarded import GuardedStore
from epd_common.store.local_redis import LocalRedis
from epd_common.store.redis_store import RedisStore
from epd_common.store.store import Store
from llm_core.caches.kv_store_tier import KEY_PREFIX, KVStoreTier
from llm_core.serving.engine import LLMEngine
from tests.epd_common.store.conftest import needs_redis
from tests.llm_core.caches.test_host_tier import history_turns, ids_of, make_engine
from tests.llm_core.serving.test_engine import prompt_of

pytestmark = needs_redis

SMALL = {"kv_memory_bytes": 288 << 10}  # the device pool holds about one history, not the fillers too
FILLERS = [prompt_of(90, 100 + i) for i in range(4)]


def tiered(loaded: Any, store: Store, **kw: Any) -> tuple[LLMEngine, KVStoreTier]:
    engine = make_engine(loaded, **{**SMALL, "host_kv_bytes": 16 << 20, **kw})
    engine.model_dir = loaded.model_dir
    tier = engine.attach_kv_store(store)
    assert tier is not None
    # These tests check what a fetch brings back, on a machine that may be busy: always fetch, and
    # wait long enough (the deadline and the cost call have their own test below).
    tier.probe_interval_s, tier.min_wait_s = 0.0, 5.0
    return engine, tier


def guarded(url: str, **kw: Any) -> GuardedStore:
    return GuardedStore(RedisStore(url, **kw), retry_after_s=60.0)


def first_turn(engine: LLMEngine, turns: list[list[int]], mm: Any) -> list[int]:
    """Turn 1, then the fillers push its pages out of the device pool; the prompt of turn 2."""

    async def run() -> list[int]:
        ids, _ = await ids_of(engine, turns[0], 6, mm)
        for f in FILLERS:
            await ids_of(engine, f, 2)
        return turns[0] + ids + turns[1]

    return asyncio.run(run())


def first_turn_elsewhere(loaded: Any, url: str, turns: list[list[int]], mm: Any, second: list[int]) -> int:
    """Turn 1 on an engine of its own that spills the session to the store at ``url`` and stops;
    the pages it wrote."""
    a, tier_a = tiered(loaded, guarded(url))
    try:
        assert first_turn(a, turns, mm) == second
        assert tier_a.flush()
        return tier_a.counters().written_pages
    finally:
        a.stop()


def answer(engine: LLMEngine, prompt: list[int], mm: Any) -> list[int]:
    return asyncio.run(ids_of(engine, prompt, 6, mm))[0]


@pytest.fixture
def own_redis() -> Iterator[LocalRedis]:
    """A redis-server of the test's own (some tests stop or kill it)."""
    server = LocalRedis(maxmemory_bytes=64 << 20)
    yield server
    server.stop()


@pytest.fixture
def recomputed(loaded: Any) -> Iterator[Any]:
    """The second turn's ids computed by an engine with no tiers at all."""
    turns, mm = history_turns(loaded)
    plain = make_engine(loaded)
    try:
        second = first_turn(plain, turns, mm)
        want = answer(plain, second, mm)
    finally:
        plain.stop()
    yield turns, mm, second, want


def test_a_session_returns_on_another_engine_from_redis(
    loaded: Any, own_redis: LocalRedis, recomputed: Any
) -> None:
    turns, mm, second, want = recomputed
    written = first_turn_elsewhere(loaded, own_redis.url, turns, mm, second)
    b, tier_b = tiered(loaded, guarded(own_redis.url))  # a fresh engine: empty tree, empty host tier
    try:
        got = answer(b, second, mm)
        c = tier_b.counters()
        host = b.scheduler.kv.host_tier
        assert host is not None
        restored = host.restored_tokens
        b.scheduler.kv.check_integrity(b.scheduler.running)
    finally:
        b.stop()
    assert written > 0 and c.fetched_pages > 0 and restored > 0, (written, c, restored)
    assert got == want


def test_pages_the_host_tier_drops_come_back_from_redis(
    loaded: Any, own_redis: LocalRedis, recomputed: Any
) -> None:
    turns, mm, second, want = recomputed
    # A host tier of a few pages, writing to the store only what it drops.
    engine, tier = tiered(
        loaded, guarded(own_redis.url), host_kv_bytes=40 << 10, kv_store_policy="host_evict"
    )
    try:
        assert first_turn(engine, turns, mm) == second
        assert tier.flush()
        got = answer(engine, second, mm)
        c = tier.counters()
        host = engine.scheduler.kv.host_tier
        assert host is not None
        restored = host.restored_tokens
    finally:
        engine.stop()
    assert c.written_pages > 0 and c.fetched_pages > 0 and restored > 0, (c, restored)
    assert got == want


def test_a_corrupted_value_is_dropped_and_recomputed(
    loaded: Any, own_redis: LocalRedis, recomputed: Any
) -> None:
    turns, mm, second, want = recomputed
    first_turn_elsewhere(loaded, own_redis.url, turns, mm, second)
    raw = redis.Redis.from_url(own_redis.url)
    keys: list[bytes] = sorted(raw.keys(f"{KEY_PREFIX}*"))  # type: ignore[arg-type]
    assert keys
    for k in keys[: len(keys) // 2]:  # truncate half of the values, flip a byte in one
        v = raw.get(k)
        assert isinstance(v, bytes)
        raw.set(k, v[: len(v) // 2])
    v = raw.get(keys[-1])
    assert isinstance(v, bytes)
    raw.set(keys[-1], v[:-1] + bytes([v[-1] ^ 1]))
    b, tier_b = tiered(loaded, guarded(own_redis.url))
    try:
        got = answer(b, second, mm)
        c = tier_b.counters()
    finally:
        b.stop()
    assert c.corrupt_pages >= 1, c
    assert got == want
    assert len(raw.keys(f"{KEY_PREFIX}*")) < len(keys) + 1  # the bad value was deleted (then maybe rewritten)


def test_a_stopped_then_killed_server_costs_a_recompute(
    loaded: Any, own_redis: LocalRedis, recomputed: Any
) -> None:
    turns, mm, second, want = recomputed
    first_turn_elsewhere(loaded, own_redis.url, turns, mm, second)
    pid = own_redis.pid
    assert pid is not None
    b, _ = tiered(loaded, guarded(own_redis.url, timeout_s=0.2))
    try:
        os.kill(pid, signal.SIGSTOP)  # answers nothing: every call times out
        try:
            t0 = time.monotonic()
            stopped = answer(b, second, mm)
            stopped_s = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        own_redis.stop()  # now gone: connections refused
        killed = answer(b, prompt_of(100, 55), ())
    finally:
        b.stop()
    plain = make_engine(loaded)
    try:
        want_killed = answer(plain, prompt_of(100, 55), ())
    finally:
        plain.stop()
    assert stopped == want and killed == want_killed
    assert stopped_s < 5.0


class SlowStore:
    """A real store whose reads take ``delay_s`` (a loaded or distant server)."""

    def __init__(self, store: Store, delay_s: float) -> None:
        self.store, self.delay_s, self.name = store, delay_s, store.name

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        time.sleep(self.delay_s)
        return self.store.get(keys)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_a_store_slower_than_recompute_is_abandoned_at_the_deadline(
    loaded: Any,
    own_redis: LocalRedis,
    recomputed: Any,
) -> None:
    turns, mm, second, want = recomputed
    first_turn_elsewhere(loaded, own_redis.url, turns, mm, second)
    b, tier_b = tiered(loaded, SlowStore(guarded(own_redis.url), delay_s=3.0))  # type: ignore[arg-type]
    tier_b.min_wait_s = 0.02  # the default: the deadline is what recomputing would take
    try:
        t0 = time.monotonic()
        got = answer(b, second, mm)
        took = time.monotonic() - t0
        c = tier_b.counters()
    finally:
        b.stop()
    assert got == want
    assert c.timed_out_fetches == 1 and c.fetched_pages == 0, c
    assert took < 3.0  # did not wait for the slow store
