"""Fixtures for the reliability tests: real ``epd serve`` subprocesses, loopback only, bounded.

Two servers are shared by the whole ``tests/system`` set (each takes tens of seconds to start):

- ``svc``: one encoder worker, the LLM engine, loopback fetches allowed, a short download timeout
  and a small admission limit, so that overload and slow-peer scenarios finish in seconds;
- ``fault_svc``: three encoder workers and the engine, for kill -9 scenarios.

    test ──HTTP──▶ epd serve ──▶ encoder-0..N-1, llm     (children of the serve process)
      └── HealthPoller process: GET /health every few ms, records each latency

The process helpers read /proc directly (psutil is not a dependency).
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.epd.conftest import Reply, ServeProcess, start_serve, stop_serve
from tests.fixtures.media_server import MediaServer
from tests.system import health_poll

# The download timeout of ``svc``: a trickling origin must hit it quickly.
SVC_FETCH_TOTAL_TIMEOUT_S = 2.0
# Items admitted into the encode pipeline of ``svc`` at once; beyond it the answer is 503.
SVC_MAX_INFLIGHT_ITEMS = 8
SVC_MAX_BODY_BYTES = 2 * 1024 * 1024
# Shared-memory names epd creates: the node cache directory and video-decode segments.
SHM_PREFIXES = ("psm_", "video-decode")


# -- /proc helpers -----------------------------------------------------------------------------------


def vm_rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (``VmRSS`` of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces: fields start after the last ')'.
    return int(stat.rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def child_pids(parent: int, role: str) -> list[int]:
    """Live children of ``parent`` started as ``epd.cli <role>`` (role: "encoder" or "llm")."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _ppid(int(entry)) == parent:
            argv = _cmdline(int(entry))
            if "epd.cli" in argv and role in argv[argv.index("epd.cli") + 1 : argv.index("epd.cli") + 2]:
                out.append(int(entry))
    return sorted(out)


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def shm_entries(namespace: str) -> set[str]:
    """Entries of /dev/shm that belong to epd: the namespace's cache and decode segments."""
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {n for n in names if namespace in n or n.startswith(SHM_PREFIXES)}


def shm_in_use() -> set[str]:
    """Names under /dev/shm that some live process has open or mapped (as far as /proc shows)."""
    used: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            for line in Path(f"/proc/{entry}/maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    used.add(line.split("/dev/shm/", 1)[1].split("/")[0].split(" ")[0])
            for fd in os.listdir(f"/proc/{entry}/fd"):
                target = os.readlink(f"/proc/{entry}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    used.add(target[len("/dev/shm/") :].split("/")[0].split(" ")[0])
        except OSError:
            continue
    return used


def wait_until(pred: object, timeout_s: float, what: str, interval_s: float = 0.2) -> None:
    assert callable(pred)
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


# -- concurrent /health poller -----------------------------------------------------------------------


@dataclass
class HealthPoller:
    """Polls ``GET /health`` from a process of its own (``health_poll.py``: the load generator in
    this process would otherwise add its GIL waits to the latencies); every answer's status and
    latency is recorded and read back when the block ends."""

    url: str
    interval_s: float = 0.05
    timeout_s: float = 2.0
    samples: list[tuple[int, float]] = field(default_factory=list)  # (status, seconds)
    _proc: Any = None
    _stop: Any = None
    _out: Any = None

    def __enter__(self) -> HealthPoller:
        ctx = multiprocessing.get_context("spawn")
        ready, self._stop = ctx.Event(), ctx.Event()
        self._out, child_end = ctx.Pipe(duplex=False)
        args = (f"{self.url}/health", self.interval_s, self.timeout_s, ready, self._stop, child_end)
        self._proc = ctx.Process(target=health_poll.poll, args=args, name="health-poller", daemon=True)
        self._proc.start()
        child_end.close()
        assert ready.wait(30), "the /health poller never got an answer"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._out.poll(self.timeout_s + 5):
            self.samples = self._out.recv()
        self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()

    @property
    def worst_s(self) -> float:
        return max(s for _, s in self.samples)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    assert values
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


# -- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def origin() -> Iterator[MediaServer]:
    """The loopback media server (blobs, trickle, misbehaving origins)."""
    with MediaServer() as server:
        yield server


def stop_checked(server: ServeProcess, shm_before: set[str]) -> None:
    code = stop_serve(server)
    assert code == 0, f"epd serve exited with {code}:\n{server.tail()}"
    assert not server.shm_dir.exists(), f"{server.shm_dir} was left behind"
    namespace = f"serve-{server.port}"
    new = shm_entries(namespace) - shm_before
    # Decode segments (psm_*) of other processes on this machine come and go concurrently: only a
    # new one that no live process has open or mapped is one this server leaked.
    in_use = shm_in_use()
    left = {n for n in new if namespace in n or n not in in_use}
    assert not left, f"shared memory left behind: {sorted(left)}"


@pytest.fixture(scope="session")
def svc() -> Iterator[ServeProcess]:
    """One worker + engine, short download timeout, small admission limit."""
    before = shm_entries("serve-")
    server = start_serve(
        [
            "--fetch-allow-cidrs",
            "127.0.0.0/8",
            "--fetch-total-timeout-s",
            str(SVC_FETCH_TOTAL_TIMEOUT_S),
            "--max-inflight-items",
            str(SVC_MAX_INFLIGHT_ITEMS),
            "--max-body-bytes",
            str(SVC_MAX_BODY_BYTES),
            "--health-interval-s",
            "0.5",
        ]
    )
    try:
        yield server
    finally:
        stop_checked(server, before)


@pytest.fixture(scope="session")
def fault_svc() -> Iterator[ServeProcess]:
    """Three encoder workers + engine, for kill -9 scenarios."""
    before = shm_entries("serve-")
    server = start_serve(["--encoder-workers", "3", "--health-interval-s", "0.3"])
    try:
        yield server
    finally:
        stop_checked(server, before)


def check_error(reply: Reply, status: int | tuple[int, ...], param: str | None = "<any>") -> dict[str, Any]:
    """The documented error shape: ``{"error": {"type", "message", "param"}}`` with ``status``;
    503 and 429 carry Retry-After."""
    allowed = (status,) if isinstance(status, int) else status
    assert reply.status in allowed, (reply.status, reply.body)
    assert isinstance(reply.body, dict) and set(reply.body) == {"error"}, reply.body
    err = reply.body["error"]
    assert {"type", "message", "param"} <= set(err), err
    assert isinstance(err["type"], str) and err["type"], err
    assert isinstance(err["message"], str) and err["message"], err
    if param != "<any>":
        assert err["param"] == param, err
    if reply.status in (429, 503):
        assert int(reply.headers.get("retry-after", "0")) >= 1, reply.headers
    return dict(err)


@contextmanager
def serve_pair(args: Sequence[str]) -> Iterator[tuple[ServeProcess, ServeProcess]]:
    """Two ``epd serve`` with the same ``args`` (their own ports and namespaces), both stopped and
    checked for leftovers afterwards, also when the second fails to start."""
    before = shm_entries("serve-")
    first = start_serve(args)
    try:
        second = start_serve(args)
    except BaseException:
        stop_checked(first, before)
        raise
    try:
        yield first, second
    finally:
        stop_checked(second, before)
        stop_checked(first, before)
