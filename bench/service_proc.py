"""Start a service under test as a subprocess on a free loopback port, wait until it is ready,
and stop it (with its children) afterwards. Its stdout/stderr go to a log file that is printed
when it fails to come up."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from epd.supervisor import group_alive


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the usual bind-to-0 trick; races are harmless here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServiceError(RuntimeError):
    """The service exited or did not become ready; the message carries the tail of its log."""


class ServiceProcess:
    """``cmd`` run in its own process group; ready when ``GET {base_url}{ready_path}`` answers 200."""

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        base_url: str,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        ready_path: str = "/ready",
        ready_timeout_s: float = 180.0,
    ) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.base_url = base_url
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.ready_path = ready_path
        self.ready_timeout_s = ready_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            # A new session: stop() signals the whole group, so children (workers, engine) go too.
            self._proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise ServiceError(f"{self.name} exited with {self._proc.returncode}:\n{self.log_tail()}")
                if self._ready():
                    return self
                time.sleep(0.25)
        except BaseException:  # Ctrl-C or an exit while waiting: its own session never got the signal
            self.stop()
            raise
        self.stop()
        raise ServiceError(f"{self.name} not ready after {self.ready_timeout_s:.0f} s:\n{self.log_tail()}")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + self.ready_path, timeout=2.0) as resp:
                return int(resp.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the leader (it drains and stops its own children), then SIGKILL what is left of
        its process group."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the leader's pid is the group id
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout_s)
        # Children get a moment to finish their own shutdown after the leader.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline and group_alive(pgid):
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5.0)

    @property
    def pid(self) -> int | None:
        """The leader's pid while it runs (its process group's id too)."""
        return self._proc.pid if self._proc is not None else None

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system) used so far by the service and every live descendant (its
        workers), from /proc; None when not running or not on Linux."""
        return tree_cpu_seconds(self._proc.pid) if self._proc is not None else None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> ServiceProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _stat_fields(pid: str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces): [state, ppid, ...]."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def tree_cpu_seconds(root: int) -> float | None:
    """utime + stime of ``root`` and its live descendants, in seconds (None without /proc)."""
    if not os.path.isdir("/proc"):
        return None
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        fields = _stat_fields(name)
        if fields is None or len(fields) < 13:
            continue
        pid = int(name)
        children.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime, stime (stat fields 14, 15)
    if root not in ticks:
        return None
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += ticks.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total / os.sysconf("SC_CLK_TCK")
