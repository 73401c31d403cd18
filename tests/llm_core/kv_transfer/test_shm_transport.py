"""ShmTransport: exact bytes or a KVTransferError with the right reason, consumed once, nothing
left behind, and a forged handle never opens anything."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from llm_core.kv_transfer.shm_transport import STALE_PART_S, ShmTransport, default_dir, namespace_files
from llm_core.kv_transfer.transport import KVTransferError, digest, make_transport

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[3]


class FakeClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def shm(tmp_path: Path, clock: FakeClock) -> Iterator[ShmTransport]:
    t = ShmTransport("test", root=tmp_path, clock=clock)
    yield t
    t.close()


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def reason_of(exc: pytest.ExceptionInfo[KVTransferError]) -> str:
    return exc.value.reason


def kv_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("epd-kv-"))


# ---------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("n", [0, 1, 4096, (3 << 20) + 7])
def test_round_trip_consumes_the_export(shm: ShmTransport, tmp_path: Path, n: int) -> None:
    data = payload(n, seed=n)
    handle = shm.export(data)
    assert json.loads(json.dumps(handle)) == handle  # travels in an HTTP body
    assert handle["nbytes"] == n and handle["xxh3"] == digest(data)
    assert kv_files(tmp_path) == [f"epd-kv-test-{handle['id']}"]
    out = shm.fetch(handle)
    assert out == data
    assert kv_files(tmp_path) == []  # consumed: the file is gone
    view = memoryview(out)
    assert not view.readonly  # the caller owns it (torch.frombuffer needs a writable buffer)
    if n:
        view[0] ^= 0xFF
        assert view[0] == data[0] ^ 0xFF
    with pytest.raises(KVTransferError) as e:
        shm.fetch(handle)
    assert reason_of(e) == "missing"


def test_export_copies_the_callers_buffer(shm: ShmTransport) -> None:
    data = bytearray(payload(1000))
    handle = shm.export(memoryview(data))
    expected = bytes(data)
    data[:] = bytes(1000)  # the caller reuses its buffer right after export
    assert shm.fetch(handle) == expected


def test_default_dir_and_close_removes_leftovers() -> None:
    t = make_transport("shm", namespace=f"t{os.getpid()}-close")
    handles = [t.export(payload(100, seed=i)) for i in range(3)]
    root = default_dir()
    names = [f"epd-kv-t{os.getpid()}-close-{h['id']}" for h in handles]
    assert all((root / name).is_file() for name in names)
    assert (root / names[0]).stat().st_mode & 0o777 == 0o600  # a prompt's KV is private
    t.close()
    assert not any((root / name).exists() for name in names)
    with pytest.raises(KVTransferError) as e:
        t.export(b"x")
    assert reason_of(e) == "closed"
    t.release(handles[0])  # a no-op after close


def test_across_processes(tmp_path: Path) -> None:
    """The exporter is a child process; its file survives for the parent to fetch."""
    n = (2 << 20) + 3
    code = (
        "import json, random, sys\n"
        "from llm_core.kv_transfer.shm_transport import ShmTransport\n"
        f"t = ShmTransport('xproc', root={str(tmp_path)!r})\n"
        f"print(json.dumps(t.export(random.Random(5).randbytes({n}))), flush=True)\n"
        "sys.stdin.readline()\n"  # hold the export until the parent has fetched
        "t.close()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        handle = json.loads(child.stdout.readline())
        with ShmTransport("xproc", root=tmp_path) as importer:
            assert importer.fetch(handle) == payload(n, seed=5)
        child.stdin.write("done\n")
        child.stdin.flush()
        assert child.wait(10) == 0
    finally:
        child.kill()
    assert kv_files(tmp_path) == []


# ---------------------------------------------------------------------------- failures
def test_corrupted_file_is_a_checksum_error(shm: ShmTransport, tmp_path: Path) -> None:
    handle = shm.export(payload(10_000))
    path = tmp_path / f"epd-kv-test-{handle['id']}"
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(1234)
        byte = f.read(1)
        f.seek(1234)
        f.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # a bit flip does not touch the deadline
    with pytest.raises(KVTransferError) as e:
        shm.fetch(handle)
    assert reason_of(e) == "checksum"


def test_truncated_file_is_a_size_error(shm: ShmTransport, tmp_path: Path) -> None:
    handle = shm.export(payload(10_000))
    path = tmp_path / f"epd-kv-test-{handle['id']}"
    st = path.stat()
    os.truncate(path, 5000)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(KVTransferError) as e:
        shm.fetch(handle)
    assert reason_of(e) == "size"


def test_release_then_fetch_is_missing(shm: ShmTransport, tmp_path: Path) -> None:
    handle = shm.export(payload(100))
    shm.release(handle)
    shm.release(handle)  # idempotent
    assert kv_files(tmp_path) == []
    with pytest.raises(KVTransferError) as e:
        shm.fetch(handle)
    assert reason_of(e) == "missing"


def test_expired_export_is_missing_even_before_the_reaper(
    shm: ShmTransport, tmp_path: Path, clock: FakeClock
) -> None:
    kept, expired = shm.export(b"kept", ttl_s=100.0), shm.export(b"gone", ttl_s=10.0)
    clock.now += 11.0
    with pytest.raises(KVTransferError) as e:
        shm.fetch(expired)
    assert reason_of(e) == "missing"
    assert shm.fetch(kept) == b"kept"


def test_reaper_unlinks_expired_exports(shm: ShmTransport, tmp_path: Path, clock: FakeClock) -> None:
    shm.export(b"a", ttl_s=10.0)
    kept = shm.export(b"b", ttl_s=100.0)
    clock.now += 11.0
    assert shm.reap() == 1
    assert kv_files(tmp_path) == [f"epd-kv-test-{kept['id']}"]


def test_reaper_thread_expires_with_real_time(tmp_path: Path) -> None:
    with ShmTransport("rt", root=tmp_path, reap_interval_s=0.05) as t:
        handle = t.export(b"short-lived", ttl_s=0.1)
        deadline = time.monotonic() + 3.0
        while kv_files(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert kv_files(tmp_path) == []
        with pytest.raises(KVTransferError) as e:
            t.fetch(handle)
        assert reason_of(e) == "missing"


def test_reaper_removes_dead_exporters_files_of_its_namespace_only(tmp_path: Path, clock: FakeClock) -> None:
    """A killed exporter never closes; any live instance of the namespace reaps its files."""
    now = clock.now
    files = {
        "epd-kv-test-" + "a" * 32: now - 1,  # complete, deadline passed: reaped
        "epd-kv-test-" + "b" * 32: now + 60,  # complete, still valid: kept
        "epd-kv-test-" + "c" * 32 + ".part": now - STALE_PART_S - 1,  # dead writer: reaped
        "epd-kv-test-" + "d" * 32 + ".part": now - 1,  # being written: kept
        "epd-kv-test-x-" + "e" * 32: now - 1,  # namespace "test-x": not ours
        "unrelated": now - 1e6,
    }
    for name, mtime in files.items():
        (tmp_path / name).write_bytes(b"?")
        os.utime(tmp_path / name, (mtime, mtime))
    assert [p.name for p in namespace_files("test", tmp_path)] == sorted(
        n for n in files if n.startswith("epd-kv-test-") and "-x-" not in n
    )
    with ShmTransport("test", root=tmp_path, clock=clock):  # reaps once at start
        kept = ["epd-kv-test-" + "b" * 32, "epd-kv-test-" + "d" * 32 + ".part", "epd-kv-test-x-" + "e" * 32]
        assert sorted(os.listdir(tmp_path)) == sorted([*kept, "unrelated"])


def test_arena_bytes_caps_what_one_exporter_holds(tmp_path: Path) -> None:
    with ShmTransport("cap", root=tmp_path, arena_bytes=1000) as t:
        with pytest.raises(KVTransferError) as e:
            t.export(bytes(1001))
        assert reason_of(e) == "size"
        first = t.export(bytes(600))
        with pytest.raises(KVTransferError) as e:
            t.export(bytes(600))
        assert reason_of(e) == "size"
        t.release(first)
        second = t.export(bytes(600))
        assert t.fetch(second) == bytes(600)  # a consumed export stops counting
        t.export(bytes(600))


# ---------------------------------------------------------------------------- forged handles
def _good_handle() -> dict[str, object]:
    return {"transport": "shm", "namespace": "test", "id": "0" * 32, "nbytes": 10, "xxh3": "0" * 16}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"id": "../../../etc/passwd"}, "invalid"),
        ({"id": "0" * 31 + "/"}, "invalid"),
        ({"id": "A" * 32}, "invalid"),
        ({"id": 12345}, "invalid"),
        ({"transport": "mooncake"}, "invalid"),
        ({"namespace": "other"}, "invalid"),
        ({"namespace": "../test"}, "invalid"),
        ({"nbytes": 1 << 40}, "size"),
        ({"nbytes": -1}, "size"),
        ({"nbytes": True}, "invalid"),
        ({"nbytes": 10.0}, "invalid"),
        ({"xxh3": 7}, "invalid"),
        ({"path": "/etc/passwd"}, "invalid"),
    ],
)
def test_forged_handles_open_nothing(
    shm: ShmTransport, monkeypatch: pytest.MonkeyPatch, change: dict[str, object], reason: str
) -> None:
    opened: list[object] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    handle = _good_handle() | change
    with pytest.raises(KVTransferError) as e:
        shm.fetch(handle)  # type: ignore[arg-type]
    assert reason_of(e) == reason
    assert opened == []
    shm.release(handle)  # type: ignore[arg-type]  # ignored, never raises


@pytest.mark.parametrize("handle", [None, "a string", ["list"], {}])
def test_non_dict_or_empty_handles(shm: ShmTransport, handle: object) -> None:
    with pytest.raises(KVTransferError) as e:
        shm.fetch(handle)  # type: ignore[arg-type]
    assert reason_of(e) == "invalid"


def test_planted_symlink_is_not_followed(shm: ShmTransport, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"0123456789")
    (tmp_path / f"epd-kv-test-{'0' * 32}").symlink_to(secret)
    handle = _good_handle() | {"xxh3": digest(b"0123456789")}
    with pytest.raises(KVTransferError) as e:
        shm.fetch(handle)  # type: ignore[arg-type]
    assert reason_of(e) == "invalid"
    assert secret.read_bytes() == b"0123456789"


def test_planted_fifo_neither_blocks_nor_reads(shm: ShmTransport, tmp_path: Path) -> None:
    os.mkfifo(tmp_path / f"epd-kv-test-{'0' * 32}")
    with pytest.raises(KVTransferError) as e:
        shm.fetch(_good_handle())  # type: ignore[arg-type]
    assert reason_of(e) == "invalid"


def test_concurrent_fetches_of_one_export_deliver_once(shm: ShmTransport) -> None:
    data = payload(1 << 20)
    handle = shm.export(data)
    results: list[bytes | str] = []

    def fetch() -> None:
        try:
            results.append(bytes(shm.fetch(handle)))
        except KVTransferError as e:
            results.append(e.reason)

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(results, key=str) == sorted([data, "missing", "missing", "missing"], key=str)


def test_a_file_still_being_written_is_not_visible(shm: ShmTransport, tmp_path: Path) -> None:
    (tmp_path / f"epd-kv-test-{'0' * 32}.part").write_bytes(bytes(10))
    with pytest.raises(KVTransferError) as e:
        shm.fetch(_good_handle())  # type: ignore[arg-type]
    assert reason_of(e) == "missing"


def test_64_mib_round_trip(tmp_path: Path) -> None:
    """Informal throughput (printed with -s): export, then fetch, checksums included."""
    data = os.urandom(64 << 20)
    with ShmTransport("big", root=tmp_path) as t:
        start = time.perf_counter()
        handle = t.export(data)
        exported = time.perf_counter()
        out = t.fetch(handle)
        fetched = time.perf_counter()
    assert out == data
    total = fetched - start
    print(
        f"shm 64 MiB: export {(exported - start) * 1e3:.0f} ms, fetch {(fetched - exported) * 1e3:.0f} ms, "
        f"round trip {total * 1e3:.0f} ms ({64 / 1024 / total:.2f} GiB/s)"
    )


def test_unknown_transport_name() -> None:
    with pytest.raises(ValueError, match="known: shm, mooncake"):
        make_transport("carrier-pigeon", namespace="x")  # type: ignore[arg-type]
