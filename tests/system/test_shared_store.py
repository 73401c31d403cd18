"""Two ``epd serve`` instances (their own ports, namespaces and workers) sharing one real
``redis-server``: an image encoded through the first is a hit through the second with no encoder
call there, byte for byte; a value corrupted inside Redis is detected, recomputed and replaced;
Redis killed, paused or restarted mid-run never fails a request."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from encoder.caches.embedding_tier import KEY_PREFIX
from epd_common.store.local_redis import LocalRedis
from tests.epd.conftest import ServeProcess, http_json, start_serve, unique_png
from tests.system.conftest import serve_pair, shm_entries, stop_checked

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


@pytest.fixture(scope="module")
def store() -> Iterator[LocalRedis]:
    with LocalRedis(maxmemory_bytes=256 << 20) as server:
        yield server


@pytest.fixture(scope="module")
def pair(store: LocalRedis) -> Iterator[tuple[ServeProcess, ServeProcess]]:
    args = ["--no-llm", "--store", store.url, "--store-retry-after-s", "0.5", "--health-interval-s", "0.3"]
    with serve_pair(args) as servers:
        yield servers


def encode(server: ServeProcess, png: bytes) -> dict[str, Any]:
    body = {"items": [{"data": base64.b64encode(png).decode()}]}
    status, out = http_json("POST", f"{server.url}/v1/encode?embeddings=true", body)
    assert status == 200, out
    item = out["data"][0]
    assert isinstance(item, dict)
    return item


def metric(server: ServeProcess, name: str) -> float:
    _, text = http_json("GET", f"{server.url}/metrics")
    body = text.decode() if isinstance(text, bytes) else str(text)
    for line in body.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def test_an_image_encoded_on_one_node_is_a_hit_on_the_other(pair: tuple[ServeProcess, ServeProcess]) -> None:
    first, second = pair
    png = unique_png(80, 56)
    a = encode(first, png)
    assert a["cache_hit"] is False
    time.sleep(0.5)  # the first node's worker publishes after its reply
    hits_before = metric(second, "epd_store_hits_total")
    b = encode(second, png)
    assert b["cache_hit"] is True and b["key"] == a["key"]
    assert metric(second, "epd_store_hits_total") == hits_before + 1  # answered by the store...
    assert "forward" not in b.get("timings_ms", {}) or b["timings_ms"].get("forward", 0) == 0  # ...no encode
    assert b["embedding"]["data"] == a["embedding"]["data"]  # byte-identical


def test_a_value_corrupted_inside_redis_is_recomputed_and_replaced(
    pair: tuple[ServeProcess, ServeProcess], store: LocalRedis
) -> None:
    first, second = pair
    png = unique_png(72, 40)
    a = encode(first, png)
    time.sleep(0.5)
    r = redis.Redis.from_url(store.url)
    name = KEY_PREFIX + a["key"]
    value = bytearray(r.get(name) or b"")
    assert value, "the first node did not publish"
    value[len(value) // 2] ^= 0xFF
    r.set(name, bytes(value))
    b = encode(second, png)  # the store's value fails its checksum: the second node encodes
    assert b["cache_hit"] is False and b["embedding"]["data"] == a["embedding"]["data"]
    time.sleep(0.5)
    fixed = r.get(name)
    assert fixed is not None and fixed != bytes(value)  # replaced by the re-encode's publish
    r.close()


def test_redis_killed_paused_and_restarted_never_fails_a_request(
    pair: tuple[ServeProcess, ServeProcess], store: LocalRedis
) -> None:
    first, second = pair
    assert store.pid is not None
    os.kill(store.pid, signal.SIGSTOP)  # a store that accepts and never answers
    try:
        t0 = time.perf_counter()
        assert encode(first, unique_png(64, 64))["cache_hit"] is False
        assert time.perf_counter() - t0 < 20
    finally:
        os.kill(store.pid, signal.SIGCONT)
    store.stop()  # dead
    png = unique_png(66, 50)
    assert encode(first, png)["cache_hit"] is False
    assert encode(second, png)["cache_hit"] is False  # no store: the second node encodes too
    store.start()  # back on the same port, empty
    time.sleep(1.0)  # past --store-retry-after-s
    png = unique_png(70, 46)
    deadline = time.monotonic() + 30
    while True:  # the first encode after the restart may still find the store marked down
        encode(first, png)
        time.sleep(0.5)
        if encode(second, png)["cache_hit"]:
            break
        assert time.monotonic() < deadline, "the shared store never came back"
        png = unique_png(70, 46)


def _redis_children(parent: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"redis-server" in cmd:  # its title
            out.append(int(entry))
    return out


def test_store_local_starts_a_redis_server_and_stops_it_on_exit() -> None:
    before = shm_entries("serve-")
    server = start_serve(["--no-llm", "--store", "local"])
    try:
        (pid,) = _redis_children(server.proc.pid)
        png = unique_png(60, 44)
        assert encode(server, png)["cache_hit"] is False
        assert encode(server, png)["cache_hit"] is True
    finally:
        stop_checked(server, before)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{pid}"), "epd serve left its redis-server running"
