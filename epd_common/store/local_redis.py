"""A private ``redis-server`` on loopback, for a one-machine deployment (``epd serve --store local``)
and for tests.

The server is a cache, nothing more: no persistence (``--save "" --appendonly no``), a memory
budget with LRU eviction over all keys (``--maxmemory N --maxmemory-policy allkeys-lru``), bound to
127.0.0.1 only with protected mode on. It dies with the process that started it (PR_SET_PDEATHSIG,
as ``epd.supervisor`` does for its children; note that the signal follows the *thread* that
started it, so start it from a thread that lives as long as the server should). Its log goes to
``<dir>/redis.log``; a start that fails quotes the end of it.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from epd_common.child_process import die_with_parent
from epd_common.store.store import StoreError

DEFAULT_MAXMEMORY_BYTES = 1 << 30
_PR_SET_PDEATHSIG = 1
_PORT_ATTEMPTS = 3  # a free port found by bind(0) can be taken before the server binds it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pings(port: int, timeout_s: float) -> bool:
    """Whether a server on 127.0.0.1:port answers PING with +PONG (raw RESP; no client needed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def server_pid(port: int, timeout_s: float) -> int | None:
    """The ``process_id`` of the server answering on 127.0.0.1:port (None: no answer). A started
    server must answer with its own pid: another server already on the port answers PING too."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"INFO server\r\n")
            reply = b""
            while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
                chunk = s.recv(4096)
                if not chunk:
                    break
                reply += chunk
    except OSError:
        return None
    match = re.search(rb"process_id:(\d+)", reply)
    return int(match.group(1)) if match else None


class LocalRedis:
    """Starts ``redis-server`` on 127.0.0.1 (``port`` None: a free one) and waits until it answers.

    The constructor starts it; ``start`` is idempotent (a no-op while it runs) and starts it again
    on the same port after ``stop`` or a crash. ``dir``: its working directory and log (None: a
    temporary directory, removed by ``stop``). ``binary``: the executable, looked up on PATH. Use
    as a context manager, or call ``stop`` (idempotent).
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        maxmemory_bytes: int = DEFAULT_MAXMEMORY_BYTES,
        dir: str | Path | None = None,
        binary: str = "redis-server",
        start_timeout_s: float = 10.0,
    ) -> None:
        if maxmemory_bytes <= 0:
            raise ValueError(f"maxmemory_bytes must be positive, got {maxmemory_bytes}")
        path = shutil.which(binary)
        if path is None:
            raise StoreError(
                "unavailable",
                f"{binary!r} not found on PATH: install it (Debian/Ubuntu: apt-get install redis-server)",
            )
        self._binary = path
        self._own_dir = dir is None
        self.dir = Path(tempfile.mkdtemp(prefix="epd-redis-")) if dir is None else Path(dir)
        self.maxmemory_bytes = maxmemory_bytes
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._fixed_port = port is not None
        self.port = port or 0
        self.start()

    def start(self) -> None:
        """Start the server unless it runs; the port stays the one of the first start."""
        if self.pid is not None:
            return
        self._kill()  # reap a server that died
        self.dir.mkdir(parents=True, exist_ok=True)
        attempts = 1 if self._fixed_port else _PORT_ATTEMPTS
        try:
            for attempt in range(attempts):
                if not self._fixed_port:
                    self.port = free_port()
                if self._start(self._binary, self.start_timeout_s, last=attempt == attempts - 1):
                    break
        except BaseException:
            self.stop()
            raise
        self._fixed_port = True  # a restart reuses the port: clients keep their URL

    def _start(self, path: str, timeout_s: float, *, last: bool) -> bool:
        log_path = self.dir / "redis.log"
        argv = [
            path,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--protected-mode", "yes",
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", str(self.maxmemory_bytes),
            "--maxmemory-policy", "allkeys-lru",
            "--dir", str(self.dir),
            "--logfile", str(log_path),
            "--daemonize", "no",
        ]  # fmt: skip
        quiet = subprocess.DEVNULL
        self._proc = subprocess.Popen(die_with_parent(argv), stdin=quiet, stdout=quiet, stderr=quiet)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            if server_pid(self.port, 0.2) == self._proc.pid:
                return True
            time.sleep(0.02)
        tail = self._log_tail(log_path)
        self._kill()
        if not last and "Address already in use" in tail:
            return False
        raise StoreError(
            "unavailable",
            f"redis-server on 127.0.0.1:{self.port} did not answer PING within "
            f"{timeout_s:g} s; its log ends:\n{tail}",
        )

    @staticmethod
    def _log_tail(path: Path) -> str:
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-10:])
        except OSError:
            return "(no log)"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs (tests signal it)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _kill(self, grace_s: float = 2.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a stopped server cannot act on SIGTERM
            proc.terminate()
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        else:
            proc.wait()

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 2 s, then the temporary directory is removed. Idempotent."""
        self._kill()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)  # a later start makes it again

    def __enter__(self) -> LocalRedis:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalRedis({self.url!r}, pid={self.pid})"
