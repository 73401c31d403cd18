"""A /health poller that runs in a process of its own (stdlib only, cheap to spawn).

The overload tests generate their load from an asyncio loop in the test process, which holds the
GIL most of the time; a poller thread beside it measured its own waits for the GIL as /health
latency (a 157-232 ms sample on a loaded 2-core CI machine, against a 100 ms bound). In a process
of its own the poller measures the server's answer and the OS's scheduling only.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event


def status_of(url: str, timeout: float) -> int:
    """The HTTP status of ``GET url``; 0 when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def poll(url: str, interval_s: float, timeout_s: float, ready: Event, stop: Event, out: Connection) -> None:
    """GET ``url`` every ``interval_s`` until ``stop``, then send every (status, seconds) to ``out``;
    ``ready`` is set after the first answer."""
    samples: list[tuple[int, float]] = []
    while not stop.is_set():
        t0 = time.perf_counter()
        status = status_of(url, timeout_s)
        samples.append((status, time.perf_counter() - t0))
        ready.set()
        stop.wait(interval_s)
    out.send(samples)
    out.close()
