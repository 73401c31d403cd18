"""The node cache's one writer lock: ``fcntl.flock`` on a file, plus a thread lock.

Why flock: the kernel drops it when the holder's last descriptor closes, including on kill -9,
so a crashed process can never leave the cache locked. Why also a thread lock: flock belongs to
the open file description, so two threads of one process sharing the descriptor would both
"hold" it. Why reopen after fork: a child inheriting the parent's descriptor would share the
parent's lock the same way.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class FileLock:
    """An exclusive lock shared by every process that opens the same ``path``."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._thread_lock = threading.Lock()
        self._pid = os.getpid()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)

    def _fd_for_this_process(self) -> int:
        if self._pid != os.getpid():  # forked: get our own open file description
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o666)
            self._thread_lock = threading.Lock()
            self._pid = os.getpid()
        return self._fd

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for the ``with`` body (blocking)."""
        with self._thread_lock:
            fd = self._fd_for_this_process()
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd >= 0 and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = -1


def try_lock_file(fd: int) -> bool:
    """Take a non-blocking exclusive flock on ``fd``; False when another description holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock_file(fd: int) -> None:
    """Take a blocking exclusive flock on ``fd``."""
    fcntl.flock(fd, fcntl.LOCK_EX)
