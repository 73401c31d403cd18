"""keep_freed_memory: large buffers freed and allocated again stop costing page faults."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc setting")

# 40 MiB: above the largest mmap threshold glibc adapts to by itself (32 MiB).
_PROBE = """
import ctypes, json, resource
from epd.allocator import keep_freed_memory
applied = keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 40 << 20
def cycle():
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)  # touch every page
    libc.free(p)
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    cycle()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _probe(keep: str) -> dict[str, float]:
    env = {**os.environ, "EPD_KEEP_FREED_MEMORY": keep}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_freed_buffers_are_reused_without_page_faults() -> None:
    kept, default = _probe("1"), _probe("0")
    pages = (40 << 20) / 4096
    assert kept["applied"] and not default["applied"]
    assert default["faults"] > 0.9 * pages  # glibc maps and unmaps the buffer every time
    assert kept["faults"] < 0.05 * pages  # the heap keeps it: touched pages stay mapped
