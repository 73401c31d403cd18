"""Children that stop when the process that started them dies, set up without Python code between
fork and exec (a ``preexec_fn`` in a threaded process can deadlock on a lock another thread held at
the fork, which is why ``subprocess`` warns against it).

    argv prefixed with ``setpriv --pdeathsig TERM --`` (util-linux): the kernel sends the child
    SIGTERM when its parent exits, a setting that survives exec; where ``setpriv`` is missing, an
    epd child arms the same itself first thing (``arm_from_env``: ``EPD_PARENT_PID`` says whose
    death to watch, and a parent already gone is seen at once).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import sys
from collections.abc import Sequence

PARENT_ENV = "EPD_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent(argv: Sequence[str]) -> tuple[str, ...]:
    """``argv`` run so that it gets SIGTERM when this process dies (as it is where ``setpriv`` is
    missing: then ``child_env`` lets an epd child arm itself)."""
    setpriv = shutil.which("setpriv")
    return (setpriv, "--pdeathsig", "TERM", "--", *argv) if setpriv else tuple(argv)


def child_env() -> dict[str, str]:
    """What a child needs to arm itself when no ``setpriv`` did (harmless where one did)."""
    return {PARENT_ENV: str(os.getpid())}


def arm_from_env() -> None:
    """In an epd child: SIGTERM when the parent named in the environment dies; exit now when it
    already has. A no-op outside Linux or without the variable."""
    parent = os.environ.pop(PARENT_ENV, "")
    if not parent.isdigit() or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):
        sys.exit("epd: the process that started this one is gone")
