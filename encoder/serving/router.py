"""Consistent-hash routing of MediaKeys to encoder workers, with retries and single-flight.

The same media always goes to the same worker (so its embedding is computed once and lands in
that worker's node cache), and a membership change moves only the keys it must:

    ring (uhashring, md5 points; ``vnodes * weight`` points per worker)
       0 ─── A ── B ── A ── C ── B ── C ── A ── ... ─── 2^128
                ▲ key hashes here: owner B, then C, A  (= ring_order(key))

- Weights: a worker with weight 2 owns ~2x the points, so ~2x the keys (capacity-weighted).
- Membership: the ring is immutable; ``set_workers``/``mark_down``/``mark_up`` build a new one
  and swap the reference, so a reader never sees a half-built ring.
- Down workers (failed health checks or connection errors) leave the ring; their keys move to
  the next worker clockwise and come back when the worker is healthy again. When every worker
  is down the router tries all of them anyway (a panic mode: better a likely failure than a
  certain one).
- Retry: a call that fails with a retryable error (connection failure, timeout, 5xx) moves on
  to the next worker in ``ring_order``; other errors (a 4xx for bad media) fail at once. A worker
  that refused for load (503 with Retry-After: its expected wait) is tried past the same way;
  when every worker refused, ``AllAttemptsFailed.retry_after_s`` is the shortest wait one named.
- Refused workers: the router remembers each refusal's wait and counts it down (the worker's
  queue drains at about that pace while nothing is added), so until it is within a call's
  deadline the call passes the worker by without sending it the item: a refusal costs the
  worker nothing (``worker_wait_s``; ``expected_wait_s``: the least of them, which the ingress
  checks before it even reads a request).
- Single-flight: concurrent ``call``s for one key share one in-flight attempt.

This module knows nothing of what the call does; it only chooses URLs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from uhashring import HashRing

log = logging.getLogger(__name__)
T = TypeVar("T")
DEFAULT_VNODES = 160


class NoWorkerAvailable(Exception):
    """The router has no worker at all (503 at the edge)."""

    status = 503


class WorkerUnavailable(Exception):
    """Raise from a ``call`` function when the worker answered 5xx or could not be reached:
    the router retries on the next worker of the ring."""

    def __init__(
        self, url: str, message: str, status: int | None = None, retry_after_s: float | None = None
    ) -> None:
        """``retry_after_s``: the worker refused for load and named when to come back."""
        self.url = url
        self.status = status
        self.retry_after_s = retry_after_s
        super().__init__(f"{url}: {message}")


@dataclass(frozen=True)
class WorkerSpec:
    """One encoder worker: its base URL and its capacity weight (GPUs, or CPU slots)."""

    url: str
    weight: int = 1

    def __post_init__(self) -> None:
        if not self.url:
            raise ValueError("WorkerSpec.url must not be empty")
        if self.weight < 1:
            raise ValueError(f"WorkerSpec.weight must be >= 1, got {self.weight} for {self.url}")


class AttemptFailure(NamedTuple):
    url: str
    error: BaseException


class AllAttemptsFailed(Exception):
    """Every worker tried for one key failed with a retryable error."""

    status = 503

    def __init__(self, key: str, attempts: list[AttemptFailure]) -> None:
        self.key = key
        self.attempts = attempts
        tried = "; ".join(f"{a.url}: {a.error!r}" for a in attempts)
        super().__init__(f"all {len(attempts)} encoder workers failed for key {key[:16]}: {tried}")

    @property
    def retry_after_s(self) -> float | None:
        """The shortest wait a refusing worker named (None: none refused for load)."""
        waits = [
            a.error.retry_after_s
            for a in self.attempts
            if isinstance(a.error, WorkerUnavailable) and a.error.retry_after_s is not None
        ]
        return min(waits) if waits else None


def is_retryable(error: BaseException) -> bool:
    """Connection failures, timeouts and 5xx answers are worth another worker; nothing else."""
    if isinstance(error, WorkerUnavailable | ConnectionError | TimeoutError | asyncio.TimeoutError):
        return True
    try:
        import aiohttp
    except ImportError:  # pragma: no cover - aiohttp is a dependency
        return False
    if isinstance(error, aiohttp.ClientResponseError):
        return error.status >= 500
    return isinstance(error, aiohttp.ClientConnectionError)


def _is_connection_error(error: BaseException) -> bool:
    if isinstance(error, ConnectionError):
        return True
    try:
        import aiohttp
    except ImportError:  # pragma: no cover
        return False
    return isinstance(error, aiohttp.ClientConnectorError)


class _Ring:
    """An immutable snapshot: the hash ring over some workers."""

    def __init__(self, workers: Sequence[WorkerSpec], vnodes: int) -> None:
        self.urls = tuple(w.url for w in workers)
        nodes = {w.url: {"weight": w.weight, "vnodes": vnodes} for w in workers}
        self._ring = HashRing(nodes=nodes) if nodes else None

    def pick(self, key: str) -> str | None:
        return None if self._ring is None else str(self._ring.get_node(key))

    def order(self, key: str) -> list[str]:
        if self._ring is None:
            return []
        return [str(node["nodename"]) for node in self._ring.range(key)]


class EncoderRouter:
    """Routes MediaKeys over encoder workers. Use from one event loop."""

    def __init__(
        self,
        workers: Sequence[WorkerSpec],
        *,
        vnodes: int = DEFAULT_VNODES,
        max_attempts: int | None = None,
        retryable: Callable[[BaseException], bool] = is_retryable,
        down_on_connection_error: bool = True,
        fall_after: int = 2,
        rise_after: int = 1,
    ) -> None:
        """``max_attempts`` caps how many workers one call tries (default: all live ones).
        ``fall_after``/``rise_after``: consecutive failed/passed health checks that take a
        worker out of the ring / put it back. ``down_on_connection_error`` takes a worker out
        at once when a call cannot connect to it (the health loop puts it back)."""
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.vnodes = vnodes
        self.max_attempts = max_attempts
        self.retryable = retryable
        self.down_on_connection_error = down_on_connection_error
        self.fall_after = fall_after
        self.rise_after = rise_after
        self._workers: dict[str, WorkerSpec] = {}
        self._down: set[str] = set()
        self._fails: dict[str, int] = {}
        self._passes: dict[str, int] = {}
        self._inflight: dict[str, asyncio.Task[Any]] = {}
        self._refused: dict[str, tuple[float, float]] = {}  # url -> (monotonic time, wait it named)
        self._live_ring = _Ring([], vnodes)
        self._all_ring = _Ring([], vnodes)
        self.set_workers(workers)

    # ------------------------------------------------------------------ membership
    def set_workers(self, workers: Sequence[WorkerSpec]) -> None:
        """Replace the worker list (new workers start as up; removed ones are forgotten)."""
        specs: dict[str, WorkerSpec] = {}
        for w in workers:
            if w.url in specs:
                raise ValueError(f"worker {w.url} listed twice")
            specs[w.url] = w
        self._workers = specs
        self._down &= set(specs)
        self._rebuild()

    def _rebuild(self) -> None:
        # Build both rings fully, then swap references: readers hold whichever they grabbed.
        live = [w for u, w in self._workers.items() if u not in self._down]
        self._live_ring = _Ring(live, self.vnodes)
        self._all_ring = _Ring(list(self._workers.values()), self.vnodes)

    def mark_down(self, url: str) -> None:
        """Take ``url`` out of the ring (its keys move to the next worker clockwise)."""
        if url in self._workers and url not in self._down:
            log.warning("encoder worker %s marked down", url)
            self._down.add(url)
            self._rebuild()

    def mark_up(self, url: str) -> None:
        """Put ``url`` back; its keys return to it."""
        if url in self._down:
            log.info("encoder worker %s marked up", url)
            self._down.discard(url)
            self._rebuild()

    @property
    def workers(self) -> list[WorkerSpec]:
        return list(self._workers.values())

    @property
    def live_workers(self) -> list[str]:
        return [u for u in self._workers if u not in self._down]

    def _ring(self) -> _Ring:
        return self._live_ring if self._live_ring.urls else self._all_ring

    # ------------------------------------------------------------------ routing
    def pick(self, key: str) -> str:
        """The worker that owns ``key`` now."""
        url = self._ring().pick(key)
        if url is None:
            raise NoWorkerAvailable("the encoder router has no workers configured")
        return url

    def ring_order(self, key: str) -> list[str]:
        """Live workers in the order a call for ``key`` tries them (owner first)."""
        return self._ring().order(key)

    def worker_wait_s(self, url: str, now: float | None = None) -> float:
        """What ``url`` would make a new item wait, from its last refusal counted down (0: it has
        not refused, or its queue should have drained to nothing since)."""
        seen = self._refused.get(url)
        if seen is None:
            return 0.0
        now = time.monotonic() if now is None else now
        return max(seen[1] - (now - seen[0]), 0.0)

    def expected_wait_s(self) -> float:
        """The shortest wait any live worker would give a new item (``worker_wait_s``)."""
        now = time.monotonic()
        return min((self.worker_wait_s(u, now) for u in self.live_workers), default=0.0)

    def note_refusal(self, url: str, wait_s: float) -> None:
        """``url`` refused an item for load, naming ``wait_s``."""
        self._refused[url] = (time.monotonic(), wait_s)

    async def call(self, key: str, fn: Callable[[str], Awaitable[T]], deadline_s: float | None = None) -> T:
        """Run ``fn(url)`` on the owner of ``key``, retrying on the next workers of the ring; with
        ``deadline_s``, workers whose counted-down refusal is past it are passed by.

        Concurrent calls for the same key share one attempt and all get its result (or its
        exception); cancelling one caller does not cancel the others' attempt.
        """
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.ensure_future(self._attempts(key, fn, deadline_s))
            self._inflight[key] = task
            task.add_done_callback(functools.partial(self._finished, key))
        return await asyncio.shield(task)  # type: ignore[no-any-return]

    def _finished(self, key: str, task: asyncio.Task[Any]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved here so an abandoned failure is not logged as lost

    def inflight(self) -> int:
        """Keys with an attempt in progress."""
        return len(self._inflight)

    async def _attempts(self, key: str, fn: Callable[[str], Awaitable[T]], deadline_s: float | None) -> T:
        order = self.ring_order(key)
        if not order:
            raise NoWorkerAvailable("the encoder router has no workers configured")
        if self.max_attempts is not None:
            order = order[: self.max_attempts]
        failures: list[AttemptFailure] = []
        for url in order:
            wait = self.worker_wait_s(url)
            if deadline_s is not None and wait > 0 and wait > deadline_s:
                message = (
                    f"refused recently; expected wait {wait:.1f} s is past the {deadline_s:g} s deadline"
                )
                failures.append(AttemptFailure(url, WorkerUnavailable(url, message, 503, wait)))
                continue
            try:
                return await fn(url)
            except Exception as e:
                if not self.retryable(e):
                    raise
                failures.append(AttemptFailure(url, e))
                if isinstance(e, WorkerUnavailable) and e.retry_after_s is not None:
                    self.note_refusal(url, e.retry_after_s)  # routine under load: not a warning
                    log.debug("encoder worker %s refused key %s: %s", url, key[:16], e)
                else:
                    log.warning("encoder worker %s failed for key %s: %r; trying the next", url, key[:16], e)
                if self.down_on_connection_error and _is_connection_error(e):
                    self.mark_down(url)
        raise AllAttemptsFailed(key, failures)

    # ------------------------------------------------------------------ health
    def report_health(self, url: str, healthy: bool) -> None:
        """Feed one health-check result; ``fall_after``/``rise_after`` in a row flip the state."""
        if url not in self._workers:
            return
        if healthy:
            self._fails[url] = 0
            self._passes[url] = self._passes.get(url, 0) + 1
            if self._passes[url] >= self.rise_after:
                self.mark_up(url)
        else:
            self._passes[url] = 0
            self._fails[url] = self._fails.get(url, 0) + 1
            if self._fails[url] >= self.fall_after:
                self.mark_down(url)

    async def check_all(
        self, check: Callable[[str], Awaitable[bool]], timeout_s: float = 2.0
    ) -> dict[str, bool]:
        """Run ``check`` on every configured worker at once and feed the results."""
        urls = list(self._workers)

        async def one(url: str) -> bool:
            try:
                return bool(await asyncio.wait_for(check(url), timeout_s))
            except Exception:
                return False

        results = dict(zip(urls, await asyncio.gather(*(one(u) for u in urls)), strict=True))
        for url, ok in results.items():
            self.report_health(url, ok)
        return results
