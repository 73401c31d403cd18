"""Engine counters for /health and /metrics: a snapshot record and a sliding-window token rate."""

from __future__ import annotations

import collections
import time
from typing import NamedTuple


class EngineStats(NamedTuple):
    """A point-in-time view of the engine (values may lag the step thread by one step)."""

    num_running: int
    num_waiting: int
    # pages in use / the most the group can hold (0..1); with the shared block pool, the share of
    # its blocks the group's pages take
    kv_full_usage: float  # the full-attention group
    kv_window_usage: float  # the fullest sliding-window group
    # the KV storage as a whole: blocks in use / blocks of the shared pool (with a pool per group,
    # the fullest group's usage): what runs out first
    kv_pool_usage: float
    generation_tokens_total: int
    prompt_tokens_total: int
    cached_prompt_tokens_total: int  # prompt tokens served from the prefix cache (finished requests)
    tokens_per_s: float  # generated tokens per second over the last few seconds
    steps_total: int
    max_waiting: int
    expected_wait_s: float  # admission's last estimate (when a request arriving then would be done)
    admission_tokens_per_s: float  # prompt + sampled tokens per busy second (the seed until measured)
    refusals: dict[str, int]  # requests refused at admission, by reason ("wait", "memory")
    # speculative decoding (0 when off): drafts verified, drafts accepted, mean tokens per verify
    spec_draft_tokens_total: int = 0
    spec_accepted_tokens_total: int = 0
    spec_acceptance_length: float = 0.0


class EngineLoad(NamedTuple):
    """What a router reconciles its own counters with (read under the engine's lock)."""

    request_ids: list[str]  # every request the engine holds, waiting or running
    num_prefill_tokens: int  # prompt tokens not computed yet (waiting and prefilling sequences)
    num_decode_tokens: int  # context tokens of the decoding sequences


class ThroughputMeter:
    """Tokens per second over a sliding window (``window_s``), plus the running total.

    Written by the engine thread, read by the event loop; a deque append/popleft is atomic under the
    GIL and a slightly stale rate is fine for metrics.
    """

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self.total = 0
        self._events: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, n: int, now: float | None = None) -> None:
        if n <= 0:
            return
        now = time.monotonic() if now is None else now
        self.total += n
        self._events.append((now, n))
        self._trim(now)

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        events = list(self._events)
        if not events:
            return 0.0
        # Early on the window is not full yet: divide by the time actually covered.
        span = min(self.window_s, max(now - events[0][0], 1e-3))
        return sum(n for _, n in events) / span

    def _trim(self, now: float) -> None:
        while self._events and now - self._events[0][0] > self.window_s:
            self._events.popleft()
