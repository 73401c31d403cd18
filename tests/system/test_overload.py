"""Overload: offered load far above capacity is refused at the edge, not queued.

1. closed loop, one client at a time: the unloaded latency (P99) of a small-image encode;
2. closed loop, as many clients as the admission limit: the capacity (requests/s);
3. open loop at 3x capacity (evenly spaced arrivals, fresh images: every one a cache miss):
   admitted requests keep P99 within 3x the unloaded P99, the rest get 503/429 with
   Retry-After; the ingress's RSS stays bounded; ``/health`` answers within 100 ms throughout.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import pytest

from tests.epd.conftest import ServeProcess, image_bytes, multipart, photo, start_serve
from tests.system.conftest import HealthPoller, percentile, shm_entries, stop_checked, vm_rss_kib

UNLOADED_S = 3.0
CAPACITY_S = 4.0
OVERLOAD_S = 10.0  # the issue allows up to 20 s; 10 s of 3x load already refuses hundreds
OVERLOAD_FACTOR = 3.0
RSS_GROWTH_LIMIT_KIB = 150 * 1024
# Items admitted at once. Admitted latency is bounded by the queue a request can find ahead of it,
# so a P99 within 3x the unloaded one needs a limit near the worker's own concurrency.
MAX_INFLIGHT_ITEMS = 1


@pytest.fixture(scope="module")
def small_svc() -> Iterator[ServeProcess]:
    """Encode only (no engine), one worker, a tight admission limit."""
    before = shm_entries("serve-")
    server = start_serve(["--no-llm", "--max-inflight-items", str(MAX_INFLIGHT_ITEMS)])
    try:
        yield server
    finally:
        stop_checked(server, before)


_seed = iter(range(50_000, 10**9))


def fresh_body() -> tuple[bytes, dict[str, str]]:
    """A multipart upload of one small PNG nobody sent before (a guaranteed cache miss)."""
    return multipart([("p.png", image_bytes(photo(56, 56, next(_seed)), "PNG"), "image/png")])


@dataclass(frozen=True)
class Outcome:
    status: int
    latency_s: float
    retry_after: str | None


async def _post(session: aiohttp.ClientSession, url: str, body: tuple[bytes, dict[str, str]]) -> Outcome:
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body[0], headers=body[1]) as resp:
            await resp.read()
            return Outcome(resp.status, time.perf_counter() - t0, resp.headers.get("Retry-After"))
    except (aiohttp.ClientError, TimeoutError) as exc:  # a hang or a reset: recorded, then asserted on
        return Outcome(-1, time.perf_counter() - t0, type(exc).__name__)


async def _closed_loop(url: str, clients: int, seconds: float) -> list[Outcome]:
    out: list[Outcome] = []
    bodies = [fresh_body() for _ in range(400)]
    deadline = time.perf_counter() + seconds
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client() -> None:
            while time.perf_counter() < deadline and bodies:
                out.append(await _post(session, url, bodies.pop()))

        await asyncio.gather(*(client() for _ in range(clients)))
    return out


async def _open_loop(url: str, rate: float, seconds: float) -> list[Outcome]:
    n = max(1, int(rate * seconds))
    bodies = [fresh_body() for _ in range(n)]  # built before the clock starts
    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = time.perf_counter()
        tasks = []
        for i, body in enumerate(bodies):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(_post(session, url, body)))
        return list(await asyncio.gather(*tasks))


def _latency_failures(url: str, health_url: str) -> list[str]:
    """One overload round. Structural expectations are asserted here; the timing ones (admitted
    P99, /health latency) come back as messages so the caller can give a noisy machine one more
    round. Returns the timing failures."""
    unloaded = asyncio.run(_closed_loop(url, 1, UNLOADED_S))
    assert unloaded and all(o.status == 200 for o in unloaded), unloaded
    unloaded_p99 = percentile([o.latency_s for o in unloaded], 99)

    t0 = time.perf_counter()
    # As many clients as the server admits at once: the most it serves without refusing.
    measured = asyncio.run(_closed_loop(url, MAX_INFLIGHT_ITEMS, CAPACITY_S))
    capacity = len(measured) / (time.perf_counter() - t0)
    assert all(o.status == 200 for o in measured), measured

    with HealthPoller(health_url) as health:
        offered = asyncio.run(_open_loop(url, OVERLOAD_FACTOR * capacity, OVERLOAD_S))

    admitted = [o for o in offered if o.status == 200]
    refused = [o for o in offered if o.status in (429, 503)]
    other = [o for o in offered if o.status not in (200, 429, 503)]
    summary = (
        f"capacity {capacity:.1f}/s, offered {len(offered)}, admitted {len(admitted)}, "
        f"refused {len(refused)}, unloaded P99 {unloaded_p99 * 1e3:.0f} ms"
    )
    assert not other, f"{summary}; unexpected outcomes: {other[:5]}"
    assert refused, f"nothing was refused at {OVERLOAD_FACTOR}x capacity ({summary})"
    assert admitted, summary
    assert all(o.retry_after is not None and int(o.retry_after) >= 1 for o in refused), refused[:5]
    assert health.samples and all(s == 200 for s, _ in health.samples), health.samples[:10]

    failures = []
    admitted_p99 = percentile([o.latency_s for o in admitted], 99)
    if admitted_p99 > 3 * unloaded_p99:
        failures.append(f"admitted P99 {admitted_p99 * 1e3:.0f} ms > 3x unloaded ({summary})")
    if health.worst_s >= 0.1:
        failures.append(
            f"/health took {health.worst_s * 1e3:.0f} ms under overload "
            f"(P50 {percentile([s for _, s in health.samples], 50) * 1e3:.1f} ms)"
        )
    return failures


@pytest.mark.timeout(180)
def test_overload_refuses_excess_keeps_admitted_latency_and_health(small_svc: ServeProcess) -> None:
    url = f"{small_svc.url}/v1/encode"
    rss_before = vm_rss_kib(small_svc.proc.pid)
    # Timing on a shared 2-core machine: one more full round before a latency bound counts as
    # broken (every refusal, status and Retry-After expectation is checked in both rounds).
    failures = _latency_failures(url, small_svc.url)
    if failures:
        failures = _latency_failures(url, small_svc.url)
    rss_after = vm_rss_kib(small_svc.proc.pid)
    assert not failures, failures
    assert rss_after - rss_before < RSS_GROWTH_LIMIT_KIB, (rss_before, rss_after)
