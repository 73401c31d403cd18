"""A burst that one encoder worker drains within the deadline is served whole: 200 concurrent
distinct uploads to `epd serve` (defaults, one worker), none refused (admission by expected wait,
``epd_common.admission``; a fixed limit of 64 items in flight refused two thirds of this burst)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.epd.conftest import image_bytes, multipart, photo, start_serve
from tests.system.conftest import percentile, shm_entries, stop_checked

BURST = 200


async def _burst(url: str, bodies: list[tuple[bytes, dict[str, str]]]) -> list[tuple[int, float, bytes]]:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def one(body: tuple[bytes, dict[str, str]]) -> tuple[int, float, bytes]:
            t0 = time.perf_counter()
            async with session.post(url, data=body[0], headers=body[1]) as resp:
                text = await resp.read()
                return resp.status, time.perf_counter() - t0, text

        return list(await asyncio.gather(*(one(b) for b in bodies)))


@pytest.mark.timeout(240)
def test_a_burst_of_200_distinct_uploads_is_served_whole() -> None:
    bodies = [
        multipart([("p.jpg", image_bytes(photo(320, 240, 90_000 + i), "JPEG"), "image/jpeg")])
        for i in range(BURST)
    ]
    before = shm_entries("serve-")
    server = start_serve(["--no-llm"])
    try:
        got = asyncio.run(_burst(f"{server.url}/v1/encode", bodies))
    finally:
        stop_checked(server, before)
    statuses = [s for s, _, _ in got]
    times = [t for _, t, _ in got]
    p99 = percentile(times, 99)
    print(f"burst of {BURST}: P50 {percentile(times, 50):.2f} s, P99 {p99:.2f} s")
    refused = [body[:400] for s, _, body in got if s != 200]
    assert not refused, ({s: statuses.count(s) for s in set(statuses)}, refused[:3])
    assert p99 < 10.0  # within the default deadline (--encoder-max-queue-wait-s)
