"""Sustained overload is refused by expected wait, not queued without bound and not refused early.

For uploads (``epd serve --no-llm``, one encoder worker) and for chats (the engine), defaults:

1. closed loop, many clients: the capacity (requests/s);
2. open loop at 3x capacity for 20 s (evenly spaced arrivals, every upload a cache miss, every
   chat a distinct prompt), then one deadline more of the same load, so that every refusal of
   the 20 s has its drain happen under the load it was predicted for;
3. admitted requests' P99 stays within the deadline (``--max-queue-wait-s``, 10 s: for an upload
   until its answer, for a streamed chat until its first token, what a client's read timeout
   measures and what the engine's admission bounds; its decode is its max_tokens' doing); the rest get
   503 with a Retry-After within 2x of the real drain time (for a refusal at t: the time until
   the last request admitted before t was done); RSS stays bounded; ``/health`` answers within
   100 ms throughout.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import aiohttp
import pytest

from tests.epd.conftest import ServeProcess, image_bytes, multipart, photo, start_serve
from tests.system.conftest import HealthPoller, percentile, shm_entries, stop_checked, vm_rss_kib

DEADLINE_S = 10.0  # the default --max-queue-wait-s
CAPACITY_S = 5.0
CAPACITY_CLIENTS = 32
OVERLOAD_S = 20.0
OVERLOAD_FACTOR = 3.0
RSS_GROWTH_LIMIT_KIB = 300 * 1024
# Of the refusals, the share whose Retry-After must be within 2x of the drain time they predicted
# (the first ones come while the rate estimate is still converging).
RETRY_AFTER_SHARE = 0.9

Body = tuple[bytes, dict[str, str]]


@dataclass(frozen=True)
class Outcome:
    status: int
    sent: float  # perf_counter
    first: float  # the response's status line and headers: an upload's answer, a chat's first token
    done: float
    retry_after: str | None
    message: str = ""  # a refusal's: which stage refused and why

    @property
    def latency_s(self) -> float:
        """Until the response began (what the deadline bounds)."""
        return self.first - self.sent


async def _post(session: aiohttp.ClientSession, url: str, body: Body) -> Outcome:
    t0 = time.perf_counter()
    try:
        async with session.post(url, data=body[0], headers=body[1]) as resp:
            first = time.perf_counter()
            payload = await resp.read()
            done = time.perf_counter()
            message = payload[:300].decode("utf-8", "replace") if resp.status != 200 else ""
            return Outcome(resp.status, t0, first, done, resp.headers.get("Retry-After"), message)
    except (aiohttp.ClientError, TimeoutError) as exc:  # a hang or a reset: recorded, then asserted on
        now = time.perf_counter()
        return Outcome(-1, t0, now, now, type(exc).__name__)


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=120), connector=aiohttp.TCPConnector(limit=0)
    )


async def _closed_loop(url: str, make: Callable[[], Body], clients: int, seconds: float) -> list[Outcome]:
    out: list[Outcome] = []
    deadline = time.perf_counter() + seconds
    async with _session() as session:

        async def client() -> None:
            while time.perf_counter() < deadline:
                out.append(await _post(session, url, make()))

        await asyncio.gather(*(client() for _ in range(clients)))
    return out


async def _open_loop(url: str, bodies: list[Body], rate: float) -> list[Outcome]:
    async with _session() as session:
        t0 = time.perf_counter()
        tasks = []
        for i, body in enumerate(bodies):
            await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(_post(session, url, body)))
        return list(await asyncio.gather(*tasks))


def drain_ratios(outcomes: list[Outcome], until: float) -> list[float]:
    """Retry-After over the real drain time, per refusal sent before ``until``: the drain time of a
    refusal at t is how long the requests admitted before t (in flight at t) took to be done."""
    admitted = sorted((o for o in outcomes if o.status == 200), key=lambda o: o.sent)
    ratios = []
    for r in (o for o in outcomes if o.status == 503 and o.sent < until):
        t = r.done  # the refusal is decided on arrival; its answer is when the client learns it
        before_t = itertools.takewhile(lambda a, t=t: a.sent < t, admitted)  # type: ignore[misc]
        in_flight = [a.done for a in before_t if a.done > t]
        if in_flight:
            assert r.retry_after is not None
            ratios.append(float(r.retry_after) / (max(in_flight) - t))
    return ratios


def _round(
    server: ServeProcess, path: str, make: Callable[[], Body], p99_bound_s: float, share: float
) -> list[str]:
    """One overload round. Structural expectations are asserted here; the timing ones come back as
    messages so the caller can give a noisy machine one more round."""
    url = f"{server.url}{path}"
    measured = asyncio.run(_closed_loop(url, make, CAPACITY_CLIENTS, CAPACITY_S))
    assert measured and all(o.status == 200 for o in measured), [o for o in measured if o.status != 200][:5]
    capacity = len(measured) / (max(o.done for o in measured) - min(o.sent for o in measured))

    rate = OVERLOAD_FACTOR * capacity
    bodies = [make() for _ in range(int(rate * (OVERLOAD_S + DEADLINE_S)))]  # before the clock starts
    with HealthPoller(server.url) as health:
        everything = asyncio.run(_open_loop(url, bodies, rate))
    start = min(o.sent for o in everything)
    offered = [o for o in everything if o.sent < start + OVERLOAD_S]  # what is judged

    admitted = [o for o in offered if o.status == 200]
    refused = [o for o in offered if o.status == 503]
    other = [o for o in everything if o.status not in (200, 503)]
    ratios = drain_ratios(everything, until=start + OVERLOAD_S)
    summary = (
        f"{path}: capacity {capacity:.1f}/s, offered {len(offered)} at {rate:.1f}/s, admitted {len(admitted)} "
        f"({len(admitted) / OVERLOAD_S:.1f}/s), refused {len(refused)}, admitted P50/P99 "
        f"{percentile([o.latency_s for o in admitted], 50):.2f}/{percentile([o.latency_s for o in admitted], 99):.2f} s, "
        f"Retry-After/drain P10/P50/P90 {percentile(ratios, 10):.2f}/{percentile(ratios, 50):.2f}/"
        f"{percentile(ratios, 90):.2f}"
        if admitted and ratios
        else f"{path}: admitted {len(admitted)}, refused {len(refused)}"
    )
    print(summary)
    assert not other, f"{summary}; unexpected outcomes: {other[:5]}"
    assert refused, f"nothing was refused at {OVERLOAD_FACTOR}x capacity ({summary})"
    # Refused only past the deadline: at least about the capacity was served all along.
    assert len(admitted) >= 0.7 * capacity * OVERLOAD_S, summary
    assert all(o.retry_after is not None and int(o.retry_after) >= 1 for o in refused), refused[:5]
    assert health.samples and all(s == 200 for s, _ in health.samples), health.samples[:10]
    assert ratios, summary

    failures = []
    admitted_p99 = percentile([o.latency_s for o in admitted], 99)
    if admitted_p99 > p99_bound_s:
        failures.append(f"admitted P99 {admitted_p99:.2f} s > {p99_bound_s:g} s ({summary})")
    within = sum(0.5 <= r <= 2.0 for r in ratios) / len(ratios)
    if within < share:
        failures.append(f"only {within:.0%} of Retry-Afters within 2x of the drain time ({summary})")
    if health.worst_s >= 0.1:
        failures.append(
            f"/health took {health.worst_s * 1e3:.0f} ms under overload "
            f"(P50 {percentile([s for _, s in health.samples], 50) * 1e3:.1f} ms)"
        )
    return failures


def _overload(
    server: ServeProcess,
    path: str,
    make: Callable[[], Body],
    p99_bound_s: float = DEADLINE_S,
    share: float = RETRY_AFTER_SHARE,
) -> None:
    rss_before = vm_rss_kib(server.proc.pid)
    # Timing on a shared 2-core machine: one more full round before a latency bound counts as
    # broken (every refusal, status and Retry-After expectation is checked in both rounds).
    failures = _round(server, path, make, p99_bound_s, share)
    if failures:
        print("first round:", failures)
        failures = _round(server, path, make, p99_bound_s, share)
    rss_after = vm_rss_kib(server.proc.pid)
    assert not failures, failures
    assert rss_after - rss_before < RSS_GROWTH_LIMIT_KIB, (rss_before, rss_after)


@pytest.fixture(scope="module")
def encode_svc() -> Iterator[ServeProcess]:
    before = shm_entries("serve-")
    server = start_serve(["--no-llm"])
    try:
        yield server
    finally:
        stop_checked(server, before)


_seed = itertools.count(50_000)


def fresh_upload() -> Body:
    """A multipart upload of a 672x672 JPEG nobody sent before (a guaranteed cache miss). Its
    encode (2304 patches) is the bottleneck, as the encoder is in production; with thumbnails the
    bottleneck would be the ingress's HTTP parsing on these two cores, shared with this client."""
    return multipart([("p.jpg", image_bytes(photo(672, 672, next(_seed)), "JPEG"), "image/jpeg")])


@pytest.mark.timeout(300)
def test_sustained_upload_overload_is_refused_by_expected_wait(encode_svc: ServeProcess) -> None:
    _overload(encode_svc, "/v1/encode", fresh_upload)


@pytest.fixture(scope="module")
def chat_svc() -> Iterator[ServeProcess]:
    before = shm_entries("serve-")
    # KV for every running sequence (the default 64 MiB holds ~17 of these chats and preempts):
    # the engine's decode is the bottleneck, not recomputing preempted prompts
    server = start_serve(["--llm-engine-kv-memory-bytes", str(256 << 20)])
    try:
        yield server
    finally:
        stop_checked(server, before)


def fresh_chat() -> Body:
    """A text chat with a prompt of its own (no prefix shared beyond the template) and a 64-token
    answer: the engine's decode is the bottleneck, as it is in production, not the ingress's
    HTTP handling on these two cores (shared with this client)."""
    n = next(_seed)
    words = " ".join(f"w{(n * 31 + i) % 997}" for i in range(40))
    body = {
        "messages": [{"role": "user", "content": f"request {n}: {words}"}],
        "max_tokens": 64,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,  # the ingress answers once the engine's first token is there
    }
    return json.dumps(body).encode(), {"Content-Type": "application/json"}


@pytest.mark.timeout(300)
def test_sustained_chat_overload_is_refused_by_expected_wait(chat_svc: ServeProcess) -> None:
    # The engine scales its estimate by how late recent first tokens were (their 99th percentile),
    # which also lengthens Retry-After: not all of them are within 2x of the drain.
    _overload(chat_svc, "/v1/chat/completions", fresh_chat, share=0.7)
