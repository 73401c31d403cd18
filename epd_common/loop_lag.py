"""How long an event loop was stalled: a task that asks to wake every ``interval_s`` and records
how late it woke.

Work run on the loop (a JSON parse, a hash, a template render) delays every other request by its
whole length, and nothing else measures that: a request's own latency mixes it with its queueing.
The lateness of a timer is the stall itself (plus the OS's scheduling delay of the process), so
the worst of it since start is what a service's "no stall over X ms" promise is checked against:

    lag = LoopLag(); lag.start()          # on the loop being watched
    ...                                   # serve
    lag.worst_s, lag.recent_worst_s(5.0)  # since start, over the last 5 s: /health and /metrics
    await lag.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque


class LoopLag:
    """The watcher of one event loop (start and stop it on that loop)."""

    def __init__(self, interval_s: float = 0.02, window: int = 4096) -> None:
        self.interval_s = interval_s
        self.worst_s = 0.0  # since start
        # (when, how late) of the last ``window`` wake-ups (80 s at the default interval)
        self._recent: deque[tuple[float, float]] = deque(maxlen=window)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="epd-loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def recent_worst_s(self, seconds: float) -> float:
        """The worst lateness of the wake-ups of the last ``seconds`` (as far as the window goes)."""
        since = time.perf_counter() - seconds
        return max((late for at, late in self._recent if at >= since), default=0.0)

    async def _watch(self) -> None:
        while True:
            asked = time.perf_counter() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = time.perf_counter()
            late = max(now - asked, 0.0)
            self._recent.append((now, late))
            self.worst_s = max(self.worst_s, late)
