"""Each server's last refusal for load, counted down.

A server that refused named its expected wait (Retry-After). While nothing is added its queue
drains at about that pace, so the wait it would give a new request is the named wait less the
time since::

    wait_s(url) = max(named - (now - refused_at), 0)

A pool may pass a server by while that is past a request's deadline: the refusal then costs the
server nothing. A named wait is bounded (``MAX_WAIT_S``; a wait that is not a finite number counts
as 1 s): one answer of ``Retry-After: 86400`` must not shut a server out for a day. A health poll
that finds the server's queue empty clears its refusal (``clear``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

MAX_WAIT_S = 60.0  # the longest wait a refusal is believed for (requests' deadlines are ~10 s)


class RefusalClock:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._refused: dict[str, tuple[float, float]] = {}  # url -> (clock time, wait it named)

    def note(self, url: str, wait_s: float) -> None:
        """``url`` refused for load, naming ``wait_s`` (bounded to [0, ``MAX_WAIT_S``])."""
        wait = min(max(wait_s, 0.0), MAX_WAIT_S) if math.isfinite(wait_s) else 1.0
        self._refused[url] = (self._clock(), wait)

    def clear(self, url: str) -> None:
        """``url``'s queue is empty again (a health poll said so): its refusal is over."""
        self._refused.pop(url, None)

    def wait_s(self, url: str, now: float | None = None) -> float:
        """What ``url`` would make a new request wait (0: it has not refused, or its queue should
        have drained to nothing since)."""
        seen = self._refused.get(url)
        if seen is None:
            return 0.0
        now = self._clock() if now is None else now
        return max(seen[1] - (now - seen[0]), 0.0)

    def least(self, urls: Iterable[str]) -> float:
        """The shortest wait any of ``urls`` would give (0 for none)."""
        now = self._clock()
        return min((self.wait_s(u, now) for u in urls), default=0.0)
