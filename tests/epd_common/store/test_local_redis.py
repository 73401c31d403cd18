"""LocalRedis: the server it starts is configured as a loopback cache, and stopping it leaves nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from epd_common.store import StoreError
from epd_common.store.local_redis import LocalRedis, _pings
from tests.epd_common.store.conftest import needs_redis


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@needs_redis
def test_configured_as_a_loopback_cache() -> None:
    with LocalRedis(maxmemory_bytes=32 << 20) as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        r = redis.Redis.from_url(server.url)
        names = ("save", "appendonly", "maxmemory", "maxmemory-policy", "bind", "protected-mode")
        config = {k: v for name in names for k, v in r.config_get(name).items()}
        r.close()
    assert config == {
        "save": "",
        "appendonly": "no",
        "maxmemory": str(32 << 20),
        "maxmemory-policy": "allkeys-lru",
        "bind": "127.0.0.1",
        "protected-mode": "yes",
    }


@needs_redis
def test_stop_leaves_no_process() -> None:
    server = LocalRedis()
    pid, port, directory = server.pid, server.port, server.dir
    assert pid is not None and directory.is_dir() and _pings(port, 1.0)
    server.stop()
    assert gone(pid) and not _pings(port, 0.2) and not directory.exists()
    assert server.pid is None
    server.stop()  # idempotent


@needs_redis
def test_stop_of_a_stopped_server() -> None:
    server = LocalRedis()
    pid = server.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    server.stop()
    assert gone(pid) and time.monotonic() - t0 < 2.5


@needs_redis
def test_a_given_dir_is_kept(tmp_path: Path) -> None:
    with LocalRedis(dir=tmp_path / "r") as server:
        assert server.dir == tmp_path / "r"
    assert (tmp_path / "r" / "redis.log").exists()


@needs_redis
def test_a_port_in_use_names_the_cause(tmp_path: Path) -> None:
    with LocalRedis() as first:
        with pytest.raises(StoreError) as e:
            LocalRedis(port=first.port, dir=tmp_path, start_timeout_s=3.0)
        assert e.value.reason == "unavailable" and "did not answer PING" in str(e.value)
        assert "Address already in use" in str(e.value)
        assert _pings(first.port, 1.0)  # the failed start did not disturb the running one


def test_missing_binary() -> None:
    with pytest.raises(StoreError, match="apt-get install redis-server"):
        LocalRedis(binary="no-such-redis-server-binary")


@needs_redis
def test_dies_with_its_parent(tmp_path: Path) -> None:
    code = (
        "from epd_common.store.local_redis import LocalRedis; import sys, time\n"
        f"s = LocalRedis(dir={str(tmp_path)!r}); print(s.pid, s.port, flush=True); time.sleep(60)\n"
    )  # a dir of the test's own: the killed parent cannot remove a temporary one
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=Path(__file__).parents[3]
    )
    assert parent.stdout is not None
    pid, port = map(int, parent.stdout.readline().split())
    parent.kill()  # SIGKILL: no chance to stop it
    parent.wait()
    deadline = time.monotonic() + 3.0
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gone(pid) and not _pings(port, 0.2)


@needs_redis
def test_start_is_idempotent_and_restarts_on_the_same_port() -> None:
    with LocalRedis() as server:
        pid, port = server.pid, server.port
        server.start()
        assert server.pid == pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # a crash
        deadline = time.monotonic() + 2.0
        while server.pid is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        server.start()
        assert server.pid not in (None, pid) and server.port == port and _pings(port, 1.0)
        server.stop()
        server.start()  # after a stop too
        assert server.port == port and _pings(port, 1.0)
    assert not _pings(port, 0.2) and not server.dir.exists()
