"""A store that never fails its caller: errors become misses, and a store that is down is left alone.

::

      up ──(unavailable / timeout)──> down ──(retry_after_s passed)──> probing ──ok──> up
       ^                               ^                                  │
       │                               └───────────(fails again)──────────┘
       └─ too_large / invalid: counted and warned, the call answers a miss, the state stays up

While down (and while another thread's probe is in flight) every call answers at once without
touching the store: ``exists`` all False, ``get`` all None, ``put`` / ``delete`` / ``unclaim``
nothing, ``claim`` True (nobody can be asked, so the caller computes: single-flight across nodes
is lost while the store is down, never correctness). One call after ``retry_after_s`` goes through
as the probe; it brings the store back up or starts another ``retry_after_s``.

Warnings are rate-limited: one when the store goes down, one when it is back, and at most one per
``warn_interval_s`` for repeated failures. ``on_error`` sees every ``StoreError`` (for a metric).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

from epd_common.store.store import Store, StoreError, StoreStats, Value

log = logging.getLogger("epd.store")

T = TypeVar("T")
_HEALTH_REASONS = ("unavailable", "timeout")  # the reasons that say the store is unwell


class GuardCounters(NamedTuple):
    hits: int
    misses: int
    errors: int
    puts: int
    skipped_while_down: int  # calls answered without asking the store


class GuardedStore:
    """``Store`` around ``store`` whose calls never raise; see the module docstring.

    ``clock``: monotonic seconds (tests inject one to pass ``retry_after_s`` without sleeping).
    Thread-safe; the wrapped store is called outside this class's lock."""

    def __init__(
        self,
        store: Store,
        *,
        retry_after_s: float = 5.0,
        on_error: Callable[[StoreError], None] | None = None,
        warn_interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.name = store.name
        self.retry_after_s = retry_after_s
        self._on_error = on_error
        self._warn_interval_s = warn_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down_until: float | None = None  # None = up
        self._probing = False
        self._last_warning = -float("inf")
        self._hits = self._misses = self._errors = self._puts = self._skipped = 0

    @property
    def up(self) -> bool:
        """False while the store is held down (a call now would not reach it)."""
        with self._lock:
            return self._down_until is None

    @property
    def counters(self) -> GuardCounters:
        with self._lock:
            return GuardCounters(self._hits, self._misses, self._errors, self._puts, self._skipped)

    # ------------------------------------------------------------------ the guard
    def _admit(self) -> bool:
        """Whether this call may reach the store; a call after ``retry_after_s`` becomes the probe."""
        with self._lock:
            if self._down_until is None:
                return True
            if not self._probing and self._clock() >= self._down_until:
                self._probing = True
                return True
            self._skipped += 1
            return False

    def _succeeded(self) -> None:
        with self._lock:
            if self._down_until is None:
                return
            self._down_until, self._probing = None, False
        log.warning("store %s is back", self.store)

    def _failed(self, exc: BaseException) -> None:
        err = (
            exc if isinstance(exc, StoreError) else StoreError("unavailable", f"{type(exc).__name__}: {exc}")
        )
        now = self._clock()
        with self._lock:
            self._errors += 1
            health = err.reason in _HEALTH_REASONS
            went_down = health and self._down_until is None
            if health:
                self._down_until, self._probing = now + self.retry_after_s, False
            elif self._probing:  # a probe that failed for a reason of its own: the store answered
                self._down_until, self._probing = None, False
            warn = went_down or now - self._last_warning >= self._warn_interval_s
            if warn:
                self._last_warning = now
        if warn:
            state = f"; skipping it for {self.retry_after_s:g} s" if health else ""
            log.warning(
                "store %s failed: %s%s", self.store, err, state, exc_info=not isinstance(exc, StoreError)
            )
        if self._on_error is not None:
            try:
                self._on_error(err)
            except Exception:
                log.exception("the store's on_error callback failed")

    def _guarded(self, fn: Callable[[], T], fallback: T) -> T:
        if not self._admit():
            return fallback
        try:
            result = fn()
        except Exception as e:  # a StoreError; anything else is a bug in the store, still no failed call
            self._failed(e)
            return fallback
        self._succeeded()
        return result

    # ------------------------------------------------------------------ Store
    def exists(self, keys: Sequence[str]) -> list[bool]:
        return self._guarded(lambda: self.store.exists(keys), [False] * len(keys))

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        fallback: list[bytes | None] = [None] * len(keys)
        values = self._guarded(lambda: self.store.get(keys), fallback)
        hits = sum(v is not None for v in values)
        with self._lock:
            self._hits += hits
            self._misses += len(values) - hits
        return values

    def put(self, items: Sequence[tuple[str, Value]], ttl_s: float | None = None) -> None:
        def run() -> bool:
            self.store.put(items, ttl_s)
            return True

        if self._guarded(run, False):
            with self._lock:
                self._puts += len(items)

    def delete(self, keys: Sequence[str]) -> None:
        self._guarded(lambda: self.store.delete(keys), None)

    def claim(self, key: str, ttl_s: float) -> bool:
        return self._guarded(lambda: self.store.claim(key, ttl_s), True)

    def unclaim(self, key: str) -> None:
        self._guarded(lambda: self.store.unclaim(key), None)

    def stats(self) -> StoreStats:
        """The wrapped store's ``entries`` / ``bytes`` (-1 while down or when it cannot answer)
        with this guard's counters, which include the calls that never reached it."""
        inner = self._guarded(self.store.stats, None)
        c = self.counters
        return StoreStats(
            kind=self.store.name,
            location=inner.location if inner is not None else repr(self.store),
            entries=inner.entries if inner is not None else -1,
            bytes=inner.bytes if inner is not None else -1,
            hits=c.hits,
            misses=c.misses,
            errors=c.errors,
            puts=c.puts,
        )

    def close(self) -> None:
        try:
            self.store.close()
        except Exception as e:
            log.warning("closing store %s failed: %s", self.store, e)

    def __repr__(self) -> str:
        return f"GuardedStore({self.store!r})"
