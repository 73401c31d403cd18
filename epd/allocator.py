"""glibc malloc settings for epd's processes: keep freed memory for reuse (see ``keep_freed_memory``).

Torch-free on purpose: ``epd.cli`` applies it before importing any role.
"""

from __future__ import annotations

import ctypes
import os
import platform

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Make glibc's malloc reuse freed memory instead of handing it back to the kernel.

    By default glibc serves every allocation above its mmap threshold (128 KiB, rising to at most
    32 MiB) with a fresh ``mmap`` and unmaps it on ``free``. Media work allocates exactly such
    buffers per item and drops them a few milliseconds later: a 1920x1080 image's patches alone
    are 23 MB, and every one of their pages was faulted in anew each time (about 5,600 faults
    per image, ~3.5 us each on a small VM: as much system time as the whole preprocessing took in
    user time). With both thresholds at 1 GiB, large buffers come from malloc's heap and freed
    memory stays there for the next item. The cost: a process keeps its peak heap.

    Called at the start of every ``epd`` process (and by the in-process benchmarks, so they
    measure what the service runs). ``EPD_KEEP_FREED_MEMORY=0`` turns it off. Returns whether it
    was applied (never on a libc other than glibc).
    """
    if os.environ.get("EPD_KEEP_FREED_MEMORY", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES) and libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))
