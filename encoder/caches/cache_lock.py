"""The node cache's one writer lock: ``fcntl.flock`` on a file, plus a thread lock.

Why flock: the kernel drops it when the holder's last descriptor closes, including on kill -9,
so a crashed process can never leave the cache locked. Why also a thread lock: flock belongs to
the open file description, so two threads of one process sharing the descriptor would both
"hold" it. Why reopen after fork (``os.register_at_fork``): a child inheriting the parent's
descriptor would share the parent's lock the same way.
"""

from __future__ import annotations

import fcntl
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class FileLock:
    """An exclusive lock shared by every process that opens the same ``path``."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._thread_lock = threading.Lock()
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        _OPEN_LOCKS.add(self)

    def _reopen_after_fork(self) -> None:
        # Drop the inherited copy first: while any process keeps it open, a lock the parent
        # held at fork time would stay held. A new thread lock too: the inherited one may
        # have been taken by a parent thread that does not exist here.
        os.close(self._fd)
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o666)
        self._thread_lock = threading.Lock()

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for the ``with`` body (blocking)."""
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        _OPEN_LOCKS.discard(self)
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1


# Every open FileLock gets a fresh descriptor in a forked child, before the child runs any code.
_OPEN_LOCKS: weakref.WeakSet[FileLock] = weakref.WeakSet()


def _reopen_all_after_fork() -> None:
    for lock in list(_OPEN_LOCKS):
        if lock._fd >= 0:
            lock._reopen_after_fork()


os.register_at_fork(after_in_child=_reopen_all_after_fork)


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
