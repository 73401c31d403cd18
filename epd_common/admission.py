"""Admission by expected wait: admit work while what is queued ahead of it would drain within the
deadline at the rate this stage has been serving, instead of a fixed count.

A burst that drains in a few seconds is absorbed whole; only real overload (a queue that would take
longer than the deadline to drain) is refused, and the refusal's Retry-After is the drain time the
stage expects, not a constant.

    rate = ServiceRate(seed_per_s=20.0)       # a stage's measured completions per busy second
    rate.started(now); ...; rate.finished(now)
    wait = rate.expected_wait_s(queued)       # what a new unit of work would wait for its turn
    if wait > deadline_s: refuse(retry_after=wait)

The rate is measured over busy time only (time with work in flight), so an idle stage keeps the
rate it last showed rather than decaying towards zero; and only from completions that had company
(another unit still in flight), whose spacing is the stage's throughput: a lone unit's completion
is its latency, which understates a stage that overlaps or batches. Failed units (a bad input
refused in a millisecond) are not samples either. It is the completions per second over the last
``window`` samples; until ``min_samples`` it is the seed (a guess no benchmark set: being wrong
only makes the first burst's estimate wrong for a moment).
"""

from __future__ import annotations

import math
import time
from collections import deque


class ServiceRate:
    """Completions per busy second of one stage (not thread-safe: call from one thread or loop)."""

    def __init__(self, seed_per_s: float, window: int = 64, min_samples: int = 4) -> None:
        assert seed_per_s > 0 and window >= 1 and min_samples >= 1
        self.seed_per_s = seed_per_s
        self.window = window
        self.min_samples = min_samples
        self._in_flight = 0
        self._busy_since: float | None = None  # when the current busy period (or sample) began
        self._samples: deque[float] = deque(maxlen=window)  # busy seconds between completions

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def started(self, now: float | None = None) -> None:
        """A unit of work entered the stage."""
        if self._in_flight == 0:
            self._busy_since = time.monotonic() if now is None else now
        self._in_flight += 1

    def finished(self, now: float | None = None, ok: bool = True) -> None:
        """A unit of work left the stage; ``ok`` False: it failed (it stops taking capacity, but its
        time says nothing of the rate)."""
        assert self._in_flight > 0, "finished() without started()"
        now = time.monotonic() if now is None else now
        assert self._busy_since is not None
        if ok and self._in_flight >= 2:
            self._samples.append(max(now - self._busy_since, 0.0))
        self._busy_since = now
        self._in_flight -= 1
        if self._in_flight == 0:
            self._busy_since = None

    def per_s(self) -> float:
        """Completions per busy second over the recent window (the seed until enough samples)."""
        if len(self._samples) < self.min_samples:
            return self.seed_per_s
        busy = sum(self._samples)
        return len(self._samples) / busy if busy > 0 else self.seed_per_s

    def expected_wait_s(self, units: float) -> float:
        """How long ``units`` of work (e.g. those queued ahead of a new one) take at ``per_s``."""
        return max(units, 0.0) / self.per_s()


def retry_after_header(wait_s: float) -> str:
    """An HTTP Retry-After value (whole seconds, at least 1) for an expected wait."""
    return str(max(1, math.ceil(wait_s)))
