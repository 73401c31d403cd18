"""The encoder ring: MediaKeys routed over encoder workers by consistent hashing, with failover
and single-flight.

A ``ServerPool`` with the ``HashRingPolicy`` (``epd.server_pool``), and what is the encoder's
own:

- What an error means (``encoder_verdict``): a call that fails with a retryable error
  (connection failure, timeout, 5xx) moves on to the next worker of the ring; other errors (a 4xx
  for bad media) fail at once. A worker that cannot be connected to leaves the ring (a 5xx does
  not); the health loop puts it back. A worker that refused for load (``WorkerUnavailable`` with
  its Retry-After) is tried past the same way; when every worker refused,
  ``AllAttemptsFailed.retry_after_s`` is the shortest wait one named.
- Refused workers: until a worker's counted-down refusal is within a call's deadline the call
  passes it by without sending it the item, so a refusal costs the worker nothing
  (``worker_wait_s``; ``expected_wait_s``: the least of them, which the ingress checks before it
  even reads a request).
- Every worker down: the router tries all of them anyway (better a likely failure than a
  certain one).
- Single-flight: concurrent ``call``s for one key share one in-flight attempt.

It knows nothing of what the call does; it only chooses URLs.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from epd.server_pool import (
    HashRingPolicy,
    Liveness,
    NoServerAvailable,
    PoolConfig,
    RingPick,
    ServerPool,
    Verdict,
)
from epd.server_pool.attempts import FAILED, FATAL, UNREACHABLE, refused
from epd.server_pool.ring import DEFAULT_VNODES

T = TypeVar("T")


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


def encoder_verdict(
    error: BaseException,
    retryable: Callable[[BaseException], bool] = is_retryable,
    down_on_connection_error: bool = True,
) -> Verdict:
    """What a failed worker call means for the ring (see the module docstring)."""
    if not retryable(error):
        return FATAL
    if isinstance(error, WorkerUnavailable) and error.retry_after_s is not None:
        return refused(error.retry_after_s)
    if down_on_connection_error and _is_connection_error(error):
        return UNREACHABLE
    return FAILED


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
        self.ring = HashRingPolicy({}, vnodes)
        self.liveness = Liveness([], label="encoder worker", fall_after=fall_after, rise_after=rise_after)
        self.pool: ServerPool[str, RingPick] = ServerPool(
            self.liveness,
            self.ring,
            functools.partial(
                encoder_verdict, retryable=retryable, down_on_connection_error=down_on_connection_error
            ),
            PoolConfig(
                "encoder worker", max_attempts=max_attempts, all_down_tries_all=True, pass_by_refused=True
            ),
        )
        self._workers: dict[str, WorkerSpec] = {}
        self._inflight: dict[str, asyncio.Task[Any]] = {}
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
        self.ring.set_weights({u: w.weight for u, w in specs.items()})
        self.liveness.set_members(list(specs))

    def mark_down(self, url: str) -> None:
        """Take ``url`` out of the ring (its keys move to the next worker clockwise)."""
        if url in self.liveness:
            self.liveness.set(url, False)

    def mark_up(self, url: str) -> None:
        """Put ``url`` back; its keys return to it."""
        if url in self.liveness:
            self.liveness.set(url, True)

    @property
    def workers(self) -> list[WorkerSpec]:
        return list(self._workers.values())

    @property
    def live_workers(self) -> list[str]:
        return self.pool.live_members

    # ------------------------------------------------------------------ routing
    def pick(self, key: str) -> str:
        """The worker that owns ``key`` now."""
        order = self.ring_order(key)
        if not order:
            raise NoServerAvailable("the encoder router has no workers configured")
        return order[0]

    def ring_order(self, key: str) -> list[str]:
        """Live workers in the order a call for ``key`` tries them (owner first; every worker
        when all are down)."""
        return self.ring.order(key, self.pool.candidates(all_down=self.pool.all_down()))

    def worker_wait_s(self, url: str, now: float | None = None) -> float:
        """What ``url`` would make a new item wait, from its last refusal counted down (0: it has
        not refused, or its queue should have drained to nothing since)."""
        return self.pool.refusals.wait_s(url, now)

    def expected_wait_s(self) -> float:
        """The shortest wait any live worker would give a new item (``worker_wait_s``)."""
        return self.pool.expected_wait_s()

    def note_refusal(self, url: str, wait_s: float) -> None:
        """``url`` refused an item for load, naming ``wait_s``."""
        self.pool.refusals.note(url, wait_s)

    async def call(self, key: str, fn: Callable[[str], Awaitable[T]], deadline_s: float | None = None) -> T:
        """Run ``fn(url)`` on the owner of ``key``, retrying on the next workers of the ring; with
        ``deadline_s``, workers whose counted-down refusal is past it are passed by.

        Concurrent calls for the same key share one attempt and all get its result (or its
        exception); cancelling one caller does not cancel the others' attempt.
        """
        task = self._inflight.get(key)
        if task is None:
            attempt = self.pool.call(key, lambda pick: fn(pick.url), deadline_s, what=f"key {key[:16]}")
            task = asyncio.ensure_future(attempt)
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

    # ------------------------------------------------------------------ health
    def report_health(self, url: str, healthy: bool) -> None:
        """Feed one health-check result; ``fall_after``/``rise_after`` in a row flip the state."""
        self.liveness.report(url, healthy)

    async def check_all(
        self, check: Callable[[str], Awaitable[bool]], timeout_s: float = 2.0
    ) -> dict[str, bool]:
        """Run ``check`` on every configured worker at once and feed the results."""
        return await self.liveness.check_all(check, timeout_s)
