"""An ASGI app served by uvicorn in a thread of the test process, for tests that talk to a real
server over a real socket (a unix socket or a loopback port)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import uvicorn


@contextlib.contextmanager
def serve_in_thread(config: uvicorn.Config, what: str = "server") -> Iterator[uvicorn.Server]:
    """Serve ``config`` until the block ends; waits (20 s at most) until it listens."""
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, f"{what} did not start"
        time.sleep(0.02)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(timeout=10)
