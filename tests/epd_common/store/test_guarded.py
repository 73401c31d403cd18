"""GuardedStore: errors become misses; a store that is down is not called until retry_after_s passed."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import pytest

from epd_common.store import Store, StoreError, StoreStats
from epd_common.store.guarded import GuardedStore
from epd_common.store.local_redis import free_port
from epd_common.store.redis_store import RedisStore
from epd_common.store.store import Value


class FakeStore:
    """A dict with a switch that makes every call fail, and a count of calls that reached it."""

    name = "fake"

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.fail: StoreError | Exception | None = None
        self.calls = 0
        self._lock = threading.Lock()
        self.gate: threading.Event | None = None  # when set, calls wait on it

    def _enter(self) -> None:
        with self._lock:
            self.calls += 1
        if self.gate is not None:
            self.gate.wait(5)
        if self.fail is not None:
            raise self.fail

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._enter()
        return [k in self.data for k in keys]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        self._enter()
        return [self.data.get(k) for k in keys]

    def put(self, items: Sequence[tuple[str, Value]], ttl_s: float | None = None) -> None:
        self._enter()
        self.data.update((k, bytes(v)) for k, v in items)

    def delete(self, keys: Sequence[str]) -> None:
        self._enter()
        for k in keys:
            self.data.pop(k, None)

    def claim(self, key: str, ttl_s: float) -> bool:
        self._enter()
        return False

    def unclaim(self, key: str) -> None:
        self._enter()

    def stats(self) -> StoreStats:
        self._enter()
        return StoreStats("fake", "mem", len(self.data), sum(map(len, self.data.values())), 0, 0, 0, 0)

    def close(self) -> None:
        self._enter()


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def guarded(**kw) -> tuple[GuardedStore, FakeStore, Clock]:
    fake, clock = FakeStore(), Clock()
    store: Store = GuardedStore(fake, clock=clock, **kw)  # it is a Store
    assert isinstance(store, GuardedStore)
    return store, fake, clock


def test_passes_through_while_up() -> None:
    g, fake, _ = guarded()
    g.put([("epd:a", b"1")])
    assert g.get(["epd:a", "epd:b"]) == [b"1", None] and g.exists(["epd:a"]) == [True]
    assert g.claim("epd:a", 1.0) is False  # the store's answer, not the fallback
    st = g.stats()
    assert (st.kind, st.entries, st.hits, st.misses, st.puts, st.errors) == ("fake", 1, 1, 1, 1, 0)
    assert g.up and fake.calls == 5


def test_down_after_an_error_then_retried() -> None:
    g, fake, clock = guarded(retry_after_s=5.0)
    fake.data["epd:a"] = b"1"
    fake.fail = StoreError("unavailable", "connection refused")
    assert g.get(["epd:a", "epd:b"]) == [None, None]
    assert not g.up and fake.calls == 1
    # while down nothing reaches the store, and every call answers the fallback
    assert g.exists(["epd:a"]) == [False]
    assert g.get(["epd:a"]) == [None]
    g.put([("epd:c", b"3")])
    g.delete(["epd:a"])
    assert g.claim("epd:a", 1.0) is True  # nobody to ask: the caller computes
    g.unclaim("epd:a")
    st = g.stats()
    assert (st.entries, st.bytes) == (-1, -1)
    clock.t += 4.9
    g.get(["epd:a"])
    assert fake.calls == 1 and g.counters.skipped_while_down == 8
    clock.t += 0.1  # retry_after_s passed: one call probes, and fails again
    g.get(["epd:a"])
    assert fake.calls == 2 and not g.up
    g.get(["epd:a"])
    assert fake.calls == 2
    clock.t += 5.0
    fake.fail = None  # the store is back: the probe succeeds and the guard is up again
    assert g.get(["epd:a"]) == [b"1"]
    assert g.up and fake.calls == 3
    assert g.exists(["epd:a"]) == [True] and fake.calls == 4
    c = g.counters
    assert (c.errors, c.hits, c.misses, c.puts) == (2, 1, 6, 0)


def test_timeouts_also_put_it_down() -> None:
    g, fake, _ = guarded()
    fake.fail = StoreError("timeout", "read timed out")
    g.exists(["epd:a"])
    assert not g.up


@pytest.mark.parametrize("reason", ["too_large", "invalid"])
def test_request_errors_leave_it_up(reason: str) -> None:
    g, fake, _ = guarded()
    fake.fail = StoreError(reason, "this call only")  # type: ignore[arg-type]
    g.put([("epd:a", b"x")])
    assert g.up and g.counters.errors == 1 and g.counters.puts == 0
    g.put([("epd:a", b"x")])
    assert fake.calls == 2


def test_real_store_errors_never_raise() -> None:
    real = GuardedStore(RedisStore(f"redis://127.0.0.1:{free_port()}/0"))
    assert real.get(["bad key"]) == [None] and real.up  # invalid: a caller bug, not the store's health
    t0 = time.monotonic()
    assert real.get(["epd:a"]) == [None] and not real.up  # refused: down
    for _ in range(1000):
        assert real.exists(["epd:a"]) == [False]
        assert real.claim("epd:a", 1.0) is True
    assert time.monotonic() - t0 < 0.5
    assert real.counters.skipped_while_down == 2000


def test_a_bug_in_the_store_is_contained(caplog: pytest.LogCaptureFixture) -> None:
    g, fake, _ = guarded()
    fake.fail = KeyError("oops")
    with caplog.at_level(logging.WARNING, logger="epd.store"):
        assert g.get(["epd:a"]) == [None]
    assert not g.up and g.counters.errors == 1
    assert "KeyError" in caplog.text and "Traceback" in caplog.text


def test_on_error_sees_every_error_and_cannot_break_the_call() -> None:
    seen: list[str] = []

    def on_error(e: StoreError) -> None:
        seen.append(e.reason)
        raise RuntimeError("a broken metric")

    g, fake, clock = guarded(on_error=on_error, retry_after_s=1.0)
    fake.fail = StoreError("timeout", "slow")
    g.get(["epd:a"])
    clock.t += 1.0
    g.get(["epd:a"])
    fake.fail = StoreError("too_large", "big")
    clock.t += 1.0
    g.put([("epd:a", b"x")])
    assert seen == ["timeout", "timeout", "too_large"]


def test_warnings_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    g, fake, clock = guarded(retry_after_s=1.0, warn_interval_s=60.0)
    fake.fail = StoreError("unavailable", "refused")
    with caplog.at_level(logging.WARNING, logger="epd.store"):
        for _ in range(30):  # 30 failed probes within a minute: one warning
            g.get(["epd:a"])
            clock.t += 1.0
        assert len(caplog.records) == 1 and "skipping it for 1 s" in caplog.text
        clock.t += 60.0
        g.get(["epd:a"])
        assert len(caplog.records) == 2
        fake.fail = None
        clock.t += 1.0
        g.get(["epd:a"])
        assert len(caplog.records) == 3 and "is back" in caplog.records[-1].getMessage()


def test_one_probe_at_a_time() -> None:
    g, fake, clock = guarded(retry_after_s=1.0)
    fake.fail = StoreError("unavailable", "refused")
    g.get(["epd:a"])
    clock.t += 1.0
    fake.fail, fake.gate = None, threading.Event()
    probe = threading.Thread(target=g.get, args=(["epd:a"],))
    probe.start()
    while fake.calls < 2:  # the probe is inside the store
        time.sleep(0.001)
    assert g.get(["epd:b"]) == [None] and fake.calls == 2  # answered without waiting on the probe
    fake.gate.set()
    probe.join()
    assert g.up
    g.get(["epd:b"])
    assert fake.calls == 3


def test_counters_are_conserved_across_threads() -> None:
    g, fake, _ = guarded(retry_after_s=0.0)
    fake.data = {f"epd:{i}": b"v" for i in range(0, 100, 2)}

    def worker(n: int) -> None:
        for i in range(200):
            if i % 50 == 0:
                fake.fail = StoreError("unavailable", "flaky") if n % 2 else None
            g.get([f"epd:{i % 100}", f"epd:{(i + 1) % 100}"])

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c = g.counters
    assert c.hits + c.misses == 4 * 200 * 2
    assert fake.calls + c.skipped_while_down == 4 * 200
