"""MooncakeTransport over loopback TCP: exact bytes or a KVTransferError with the right reason, a
dead or stopped peer bounded by timeout_s, forged handles refused, and the arena's allocator
conserving bytes."""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from llm_core.kv_transfer.transport import KVTransferError, digest, make_transport

try:
    from llm_core.kv_transfer.mooncake_transport import (
        ALIGN,
        HEADER_BYTES,
        MooncakeTransport,
        _Arena,
        load_engine_class,
    )

    load_engine_class()
except KVTransferError as e:
    pytest.skip(f"Mooncake is not importable here: {e}", allow_module_level=True)

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[3]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def mc(clock: FakeClock) -> Iterator[MooncakeTransport]:
    t = MooncakeTransport("test", clock=clock, arena_bytes=16 << 20, recv_bytes=1 << 20)
    yield t
    t.close()


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def flip_byte(address: int) -> None:
    cell = ctypes.c_uint8.from_address(address)
    cell.value ^= 0x01


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("n", [0, 1, 4096, (3 << 20) + 7])
def test_round_trip(mc: MooncakeTransport, n: int) -> None:
    """3 MiB through 1 MiB receive buffers also covers the chunked read."""
    data = payload(n, seed=n)
    handle = mc.export(data)
    assert json.loads(json.dumps(handle)) == handle
    assert handle["nbytes"] == n and handle["xxh3"] == digest(data)
    out = mc.fetch(handle, timeout_s=5.0)
    assert isinstance(out, bytearray) and out == data
    assert mc.fetch(handle, timeout_s=5.0) == data  # unlike shm, readable until released
    mc.release(handle)


def test_chunks_smaller_than_the_header_offset(clock: FakeClock) -> None:
    """Receive buffers of 100 bytes: the header and payload straddle many chunk boundaries."""
    with MooncakeTransport("tiny", clock=clock, arena_bytes=1 << 16, recv_bytes=100) as t:
        data = payload(1000)
        assert t.fetch(t.export(data), timeout_s=5.0) == data


def test_make_transport_and_close(clock: FakeClock) -> None:
    t = make_transport("mooncake", namespace="mk", arena_bytes=1 << 20)
    handle = t.export(b"hello")
    assert handle["session"].startswith("127.0.0.1:")
    t.close()
    t.close()
    for call in (lambda: t.export(b"x"), lambda: t.fetch(handle)):
        with pytest.raises(KVTransferError) as e:
            call()
        assert e.value.reason == "closed"
    t.release(handle)  # a no-op after close


def _exporter_child(
    n: int, seed: int, arena_bytes: int = 8 << 20
) -> tuple[subprocess.Popen[str], dict[str, object]]:
    code = (
        "import json, random, sys\n"
        "from llm_core.kv_transfer.mooncake_transport import MooncakeTransport\n"
        f"t = MooncakeTransport('xproc', arena_bytes={arena_bytes})\n"
        f"print(json.dumps(t.export(random.Random({seed}).randbytes({n}))), flush=True)\n"
        "sys.stdin.readline()\n"
        "t.close()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # Mooncake's start-up log lines
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, "the exporter child died before exporting"
    return child, json.loads(line)


def test_across_processes() -> None:
    n = (2 << 20) + 3
    child, handle = _exporter_child(n, seed=5)
    try:
        with MooncakeTransport("xproc", arena_bytes=8 << 20) as importer:
            assert importer.fetch(handle, timeout_s=5.0) == payload(n, seed=5)  # type: ignore[arg-type]
        assert child.stdin is not None
        child.stdin.write("done\n")
        child.stdin.flush()
        assert child.wait(10) == 0
    finally:
        child.kill()
        child.wait()


@pytest.mark.timeout(15)
@pytest.mark.parametrize("fetch_first", [False, True])
def test_killed_exporter_fails_within_timeout(fetch_first: bool) -> None:
    """kill -9 before the fetch (a fresh connection is refused) or after one fetch (a cached
    connection dies): "transport" or "timeout", within timeout_s, never a hang."""
    child, handle = _exporter_child(1 << 20, seed=1)
    with MooncakeTransport("xproc", arena_bytes=8 << 20) as importer:
        if fetch_first:
            assert importer.fetch(handle, timeout_s=5.0) == payload(1 << 20, seed=1)  # type: ignore[arg-type]
        child.kill()
        child.wait()
        start = time.monotonic()
        with pytest.raises(KVTransferError) as e:
            importer.fetch(handle, timeout_s=2.0)  # type: ignore[arg-type]
        assert e.value.reason in ("transport", "timeout")
        assert time.monotonic() - start < 2.5


def _wait_stopped(pid: int) -> None:
    """SIGSTOP takes effect asynchronously: wait until every thread of ``pid`` is stopped ("T"),
    or a read issued right after the kill may still be served."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with suppress(FileNotFoundError):  # a thread that just ended
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        if states and all(state == "T" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


@pytest.mark.timeout(15)
def test_stopped_exporter_times_out_and_keeps_its_buffer() -> None:
    """A SIGSTOPped peer blocks Mooncake's read; fetch gives up at timeout_s, and the receive
    buffer stays with the stuck read: with one buffer, the next fetch waits rather than sharing it."""
    live, live_handle = _exporter_child(1000, seed=2)
    stopped, stopped_handle = _exporter_child(1000, seed=3)
    try:
        with MooncakeTransport("xproc", arena_bytes=8 << 20, max_recv_buffers=1) as importer:
            os.kill(stopped.pid, signal.SIGSTOP)
            _wait_stopped(stopped.pid)
            start = time.monotonic()
            with pytest.raises(KVTransferError) as e:
                importer.fetch(stopped_handle, timeout_s=1.0)  # type: ignore[arg-type]
            assert e.value.reason == "timeout"
            assert time.monotonic() - start < 1.5
            with pytest.raises(KVTransferError) as e:
                importer.fetch(live_handle, timeout_s=0.3)  # type: ignore[arg-type]
            assert e.value.reason == "timeout"  # the only buffer is still the stuck read's
            stopped.kill()  # the stuck read now fails and gives its buffer back
            stopped.wait()
            assert importer.fetch(live_handle, timeout_s=5.0) == payload(1000, seed=2)  # type: ignore[arg-type]
    finally:
        for child in (live, stopped):
            child.kill()
            child.wait()


# ---------------------------------------------------------------------------- failures
def test_corrupted_arena_is_a_checksum_error(mc: MooncakeTransport) -> None:
    handle = mc.export(payload(10_000))
    flip_byte(handle["ptr"] + HEADER_BYTES + 1234)  # exporter and importer share this process
    with pytest.raises(KVTransferError) as e:
        mc.fetch(handle, timeout_s=5.0)
    assert e.value.reason == "checksum"


def test_release_then_fetch_is_missing(mc: MooncakeTransport) -> None:
    handle = mc.export(payload(100))
    mc.release(handle)
    mc.release(handle)  # idempotent
    with pytest.raises(KVTransferError) as e:
        mc.fetch(handle, timeout_s=5.0)
    assert e.value.reason == "missing"


def test_a_reused_region_is_missing_under_the_stale_handle(mc: MooncakeTransport) -> None:
    stale = mc.export(payload(100, seed=1))
    mc.release(stale)
    fresh = mc.export(payload(100, seed=2))
    assert fresh["ptr"] == stale["ptr"]  # first fit hands the same region out again
    with pytest.raises(KVTransferError) as e:
        mc.fetch(stale, timeout_s=5.0)
    assert e.value.reason == "missing"
    assert mc.fetch(fresh, timeout_s=5.0) == payload(100, seed=2)


def test_expired_exports_are_reaped(mc: MooncakeTransport, clock: FakeClock) -> None:
    expired, kept = mc.export(b"gone", ttl_s=10.0), mc.export(b"kept", ttl_s=100.0)
    clock.now += 11.0
    assert mc.reap() == 1
    with pytest.raises(KVTransferError) as e:
        mc.fetch(expired, timeout_s=5.0)
    assert e.value.reason == "missing"
    assert mc.fetch(kept, timeout_s=5.0) == b"kept"


def test_reaper_thread_expires_with_real_time() -> None:
    with MooncakeTransport("rt", arena_bytes=1 << 20, reap_interval_s=0.05) as t:
        handle = t.export(b"short-lived", ttl_s=0.1)
        time.sleep(0.4)
        with pytest.raises(KVTransferError) as e:
            t.fetch(handle, timeout_s=5.0)
        assert e.value.reason == "missing"


def test_a_full_arena_is_a_size_error(clock: FakeClock) -> None:
    with MooncakeTransport("full", clock=clock, arena_bytes=4096) as t:
        with pytest.raises(KVTransferError) as e:
            t.export(bytes(4096))  # the header needs room too
        assert e.value.reason == "size"
        first = t.export(bytes(3000))
        with pytest.raises(KVTransferError) as e:
            t.export(bytes(3000))
        assert e.value.reason == "size"
        t.release(first)
        assert t.fetch(t.export(bytes(3000)), timeout_s=5.0) == bytes(3000)


# ---------------------------------------------------------------------------- forged handles
@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("session", "evil host:80", "invalid"),
        ("session", "127.0.0.1", "invalid"),
        ("session", "127.0.0.1:99999", "invalid"),
        ("session", "127.0.0.1:0", "invalid"),
        ("ptr", 0, "invalid"),
        ("ptr", -8, "invalid"),
        ("ptr", 1 << 64, "invalid"),
        ("ptr", True, "invalid"),
        ("ptr", "0x1000", "invalid"),
        ("nbytes", 1 << 30, "size"),
        ("id", "../etc", "invalid"),
        ("transport", "shm", "invalid"),
        ("namespace", "other", "invalid"),
    ],
)
def test_forged_handles_are_refused_before_any_read(
    mc: MooncakeTransport, field: str, value: object, reason: str
) -> None:
    handle = mc.export(b"payload")
    with pytest.raises(KVTransferError) as e:
        mc.fetch(handle | {field: value}, timeout_s=5.0)
    assert e.value.reason == reason
    assert mc._pool is None  # nothing was read: the importer's engine never started
    mc.release(handle | {field: value})  # ignored, never raises
    assert mc.fetch(handle, timeout_s=5.0) == b"payload"


def test_addresses_outside_the_arena_are_refused_by_the_peer(mc: MooncakeTransport) -> None:
    handle = mc.export(b"payload")
    outside = ctypes.create_string_buffer(4096)  # memory of the exporter's process, not registered
    for ptr in (handle["ptr"] - 4096, ctypes.addressof(outside)):
        with pytest.raises(KVTransferError) as e:
            mc.fetch(handle | {"ptr": ptr}, timeout_s=5.0)
        assert e.value.reason == "transport"
    with pytest.raises(KVTransferError) as e:  # inside the arena but not a region's start
        mc.fetch(handle | {"ptr": handle["ptr"] + ALIGN}, timeout_s=5.0)
    assert e.value.reason == "missing"


def test_make_transport_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import now raises ImportError
    with pytest.raises(KVTransferError) as e:
        make_transport("mooncake", namespace="missing")
    assert e.value.reason == "transport"
    assert "pip install mooncake-transfer-engine-non-cuda" in str(e.value)
    assert "apt-get install libibverbs1" in str(e.value)


# ---------------------------------------------------------------------------- the allocator
def test_arena_allocator_conserves_bytes() -> None:
    """Random alloc/free: live regions never overlap, free extents are sorted and coalesced, and
    live + free always cover the whole arena; everything freed leaves one extent."""
    rng = random.Random(0)
    arena = _Arena(1 << 16)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            arena.release(offset, live.pop(offset))
        else:
            size = rng.randrange(1, 40) * ALIGN
            offset_or_none = arena.alloc(size)
            if offset_or_none is not None:
                live[offset_or_none] = size
        spans = sorted([*live.items(), *arena.free])
        assert spans[0][0] == 0 and sum(size for _, size in spans) == arena.capacity
        assert all(a + sa == b for (a, sa), (b, _) in itertools.pairwise(spans))
        free = arena.free
        assert all(a + sa < b for (a, sa), (b, _) in itertools.pairwise(free))  # coalesced
    for offset, size in list(live.items()):
        arena.release(offset, size)
    assert arena.free == [(0, 1 << 16)]


def test_64_mib_round_trip_across_processes() -> None:
    """Informal throughput (printed with -s): the fetch from a child exporter over loopback TCP
    (the first one, connection set-up included, then a warm one), checksum included."""
    n = 64 << 20
    child, handle = _exporter_child(n, seed=9, arena_bytes=80 << 20)
    try:
        with MooncakeTransport("xproc", arena_bytes=80 << 20) as importer:
            times = []
            for _ in range(2):
                start = time.perf_counter()
                out = importer.fetch(handle, timeout_s=10.0)  # type: ignore[arg-type]
                times.append(time.perf_counter() - start)
        assert out == payload(n, seed=9)
        cold, warm = (f"{t * 1e3:.0f} ms ({64 / 1024 / t:.2f} GiB/s)" for t in times)
        print(f"mooncake 64 MiB fetch: first {cold}, warm {warm}")
    finally:
        child.kill()
        child.wait()
