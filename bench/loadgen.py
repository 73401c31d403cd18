"""HTTP load generation for encode services: closed-loop concurrency and open-loop Poisson arrivals.

Both modes send the same request shape to any service that speaks the ingress's encode API
(``POST {base}/v1/encode`` with JSON ``{"items": [{"url": ...}]}``), so the baseline and our
service are driven by identical client code.

    closed loop (concurrency C):  C workers, each sends its next request when the last one answers;
                                  measures capacity, latency includes no client-side queueing.
    open loop (rate R):           request i is sent at t_i = sum of i exponential gaps of mean 1/R,
                                  whether or not earlier ones have answered (no coordinated
                                  omission: a slow server makes latencies grow, not the rate fall).

This module knows nothing of media, corpora or the services themselves.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

import aiohttp

# Builds the JSON body of request number i (0-based within the run).
BodyFn = Callable[[int], dict[str, Any]]
DoneFn = Callable[[], None]


class Outcome(NamedTuple):
    """One request as the client saw it. Times are seconds since the run started."""

    seq: int  # request number within the run (0-based)
    start_s: float  # when it was sent
    end_s: float  # when the whole answer was read (or the failure seen)
    status: int  # HTTP status; 0 when no HTTP answer came (connection error, timeout)
    cache_hit: bool | None  # from the first item of the answer, when present
    error: str | None  # None for a 200 answer
    server_ms: dict[str, float]  # the first item's timings_ms, when present

    @property
    def latency_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def ok(self) -> bool:
        return self.error is None


class LoadResult(NamedTuple):
    """All outcomes of one run, in send order, and the run's wall time."""

    mode: str  # "closed" | "open"
    level: float  # concurrency (closed) or offered rate in requests/s (open)
    outcomes: list[Outcome]
    wall_s: float  # first send -> last answer

    @property
    def ok(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.ok]

    @property
    def errors(self) -> int:
        return len(self.outcomes) - len(self.ok)

    @property
    def qps(self) -> float:
        """Successful requests per second of wall time."""
        return len(self.ok) / self.wall_s if self.wall_s > 0 else 0.0

    def latencies_s(self) -> list[float]:
        return [o.latency_s for o in self.ok]


async def send_one(
    session: aiohttp.ClientSession, endpoint: str, body: dict[str, Any], index: int, t0: float
) -> Outcome:
    """POST ``body`` to ``endpoint``; never raises for a failed request (it becomes an Outcome)."""
    start = time.perf_counter() - t0
    status, cache_hit, error, server_ms = 0, None, None, {}
    try:
        async with session.post(endpoint, json=body) as resp:
            status = resp.status
            raw = await resp.read()
        if status != 200:
            error = f"HTTP {status}: {raw[:200].decode(errors='replace')}"
        else:
            first = (json.loads(raw).get("data") or [{}])[0]
            cache_hit = first.get("cache_hit")
            server_ms = {str(k): float(v) for k, v in (first.get("timings_ms") or {}).items()}
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    return Outcome(index, start, time.perf_counter() - t0, status, cache_hit, error, server_ms)


# Sends one request: (session, endpoint, body, index, t0) -> its Outcome; ``send_one`` by default,
# another API's client (e.g. chats) where the answer has another shape. Never raises for a failure.
SendFn = Callable[[aiohttp.ClientSession, str, dict[str, Any], int, float], Awaitable[Outcome]]


async def closed_loop(
    session: aiohttp.ClientSession,
    endpoint: str,
    body: BodyFn,
    *,
    concurrency: int,
    requests: int,
    on_done: DoneFn | None = None,
    send: SendFn = send_one,
) -> LoadResult:
    """Send ``requests`` requests from ``concurrency`` workers that each wait for their answer."""
    if concurrency < 1 or requests < 1:
        raise ValueError(
            f"closed loop needs concurrency >= 1 and requests >= 1, got {concurrency}, {requests}"
        )
    next_index = 0
    outcomes: list[Outcome] = []
    t0 = time.perf_counter()

    async def worker() -> None:
        nonlocal next_index
        while next_index < requests:
            i = next_index
            next_index += 1  # no await between the check and the claim: single-threaded loop
            outcomes.append(await send(session, endpoint, body(i), i, t0))
            if on_done is not None:
                on_done()

    await asyncio.gather(*(worker() for _ in range(min(concurrency, requests))))
    outcomes.sort(key=lambda o: o.seq)
    return LoadResult("closed", float(concurrency), outcomes, _wall(outcomes))


def poisson_schedule(rate: float, requests: int, seed: int) -> list[float]:
    """Send times (seconds from the start) of a Poisson process of ``rate`` per second; first at 0."""
    if rate <= 0:
        raise ValueError(f"open-loop rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def open_loop(
    session: aiohttp.ClientSession,
    endpoint: str,
    body: BodyFn,
    *,
    rate: float,
    requests: int,
    seed: int = 0,
    on_done: DoneFn | None = None,
    send: SendFn = send_one,
) -> LoadResult:
    """Send ``requests`` requests at Poisson arrival times of mean ``rate``/s, never waiting for answers."""
    schedule = poisson_schedule(rate, requests, seed)
    t0 = time.perf_counter()

    async def one(i: int) -> Outcome:
        out = await send(session, endpoint, body(i), i, t0)
        if on_done is not None:
            on_done()
        return out

    tasks: list[asyncio.Task[Outcome]] = []
    for i, at in enumerate(schedule):
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    outcomes = list(await asyncio.gather(*tasks))
    return LoadResult("open", rate, outcomes, _wall(outcomes))


def _wall(outcomes: Sequence[Outcome]) -> float:
    if not outcomes:
        return 0.0
    return max(o.end_s for o in outcomes) - min(o.start_s for o in outcomes)


def qps_timeline(result: LoadResult, bucket_s: float = 1.0) -> list[tuple[float, float]]:
    """(bucket start in s, successful answers per second in that bucket) over the run."""
    ok = result.ok
    if not ok:
        return []
    start = min(o.start_s for o in result.outcomes)
    n_buckets = int((max(o.end_s for o in ok) - start) // bucket_s) + 1
    counts = [0] * n_buckets
    for o in ok:
        counts[int((o.end_s - start) // bucket_s)] += 1
    return [(i * bucket_s, c / bucket_s) for i, c in enumerate(counts)]


def merge_results(parts: Sequence[LoadResult]) -> LoadResult:
    """Runs of the same mode and level done one after another, as one run: each part's times are
    shifted to start where the previous part's wall time ended, so QPS = all answers / summed walls."""
    assert parts, "nothing to merge"
    assert len({(p.mode, p.level) for p in parts}) == 1, "merge runs of one mode and level only"
    outcomes: list[Outcome] = []
    offset = 0.0
    for part in parts:
        if not part.outcomes:
            continue
        start = min(o.start_s for o in part.outcomes)
        base = len(outcomes)
        for o in part.outcomes:
            shift = offset - start
            outcomes.append(o._replace(seq=base + o.seq, start_s=o.start_s + shift, end_s=o.end_s + shift))
        offset += part.wall_s
    return LoadResult(parts[0].mode, parts[0].level, outcomes, offset)


def new_session(timeout_s: float = 300.0) -> aiohttp.ClientSession:
    """A client session without a connection cap (the load level is set by the generator, not the pool)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=timeout_s)
    )
