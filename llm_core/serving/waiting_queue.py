"""The waiting queue: length buckets, cache-aware priority with a waiting-time term, fair token shares.

Priority (lower runs first), for a request of L tokens of which ``hit`` are in the prefix cache::

    score = U * (1 - hit_weight * r) - wait_tokens_per_s * waited_s      U = L - hit, r = hit / L

The first term prefers requests with a high hit ratio and few uncached tokens (cheap to start,
and their cached prefix may be evicted if they wait); the second lowers the score of everyone
who has waited by ``wait_tokens_per_s`` tokens per second. Scores of new arrivals are >= 0, so a
request that has waited ``U / wait_tokens_per_s`` seconds beats any new arrival: nothing starves.

Length buckets (by prompt length, default 0-64K, 64K-256K, 256K-1M) keep short prompts from
queueing behind very long ones: each step the prefill token budget is split max-min fairly
between the buckets that have prefill work (``fair_split``), so a bucket with a short prompt gets
at least ``budget / active_buckets`` tokens no matter how long the other buckets' prompts are,
and whatever a bucket cannot use goes to the others.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from typing import NamedTuple

from llm_core.request import Sequence


class PriorityWeights(NamedTuple):
    hit_weight: float = 0.5
    wait_tokens_per_s: float = 1024.0


def priority_score(num_tokens: int, hit: int, waited_s: float, w: PriorityWeights) -> float:
    """The score above; lower is scheduled first."""
    uncached = num_tokens - hit
    ratio = hit / num_tokens if num_tokens else 0.0
    return uncached * (1.0 - w.hit_weight * ratio) - w.wait_tokens_per_s * waited_s


def fair_split(demands: list[int], budget: int, start: int = 0) -> list[int]:
    """Max-min fair shares of ``budget`` for ``demands`` (each share <= its demand).

    Water-filling: the smallest demands are met in full while they are below an equal share of
    what is left; the rest split it evenly. Leftover single tokens from integer division go
    round-robin from bucket ``start`` so no bucket is always last.
    """
    n = len(demands)
    grant = [0] * n
    left = budget
    open_ = sorted((i for i in range(n) if demands[i] > 0), key=lambda i: demands[i])
    for k, i in enumerate(open_):
        share = left // (len(open_) - k)
        if demands[i] <= share:
            grant[i] = demands[i]
            left -= demands[i]
            continue
        # Every remaining demand exceeds the equal share (they are sorted): split evenly.
        rest = sorted(open_[k:], key=lambda j: (j - start) % n)
        for r, j in enumerate(rest):
            grant[j] = share + (1 if r < left - share * len(rest) else 0)
        break
    return grant


class WaitingQueue:
    """Waiting sequences, one list per length bucket; ordering is computed when asked."""

    def __init__(self, bucket_bounds: tuple[int, ...], weights: PriorityWeights) -> None:
        assert list(bucket_bounds) == sorted(bucket_bounds) and bucket_bounds, bucket_bounds
        self.bounds = bucket_bounds
        self.weights = weights
        self._buckets: list[list[Sequence]] = [[] for _ in bucket_bounds]

    def bucket_of(self, num_tokens: int) -> int:
        """Index of the first bucket whose upper bound is >= ``num_tokens`` (the last one beyond)."""
        return min(bisect.bisect_left(self.bounds, num_tokens), len(self.bounds) - 1)

    @property
    def num_buckets(self) -> int:
        return len(self.bounds)

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets)

    def __iter__(self) -> Iterator[Sequence]:
        for b in self._buckets:
            yield from b

    def add(self, seq: Sequence) -> None:
        self._buckets[self.bucket_of(seq.num_tokens)].append(seq)

    def remove(self, seq: Sequence) -> None:
        self._buckets[self.bucket_of(seq.num_tokens)].remove(seq)

    def bucket(self, b: int) -> list[Sequence]:
        return self._buckets[b]

    def ordered(self, b: int, now: float, peek_hit: Callable[[Sequence], int]) -> list[Sequence]:
        """Bucket ``b`` best first (ties: earlier arrival first)."""
        scored = [
            (
                priority_score(s.num_tokens, peek_hit(s), now - s.arrival_time, self.weights),
                s.arrival_time,
                k,
                s,
            )
            for k, s in enumerate(self._buckets[b])
        ]
        scored.sort(key=lambda t: (t[0], t[1], t[2]))
        return [t[3] for t in scored]
