"""Consistent hashing of keys over servers: the encoder ring.

The same key always goes to the same server (an embedding is computed once and lands in that
worker's node cache), and a membership change moves only the keys it must::

    ring (uhashring, md5 points; ``vnodes * weight`` points per server)
       0 ─── A ── B ── A ── C ── B ── C ── A ── ... ─── 2^128
                ▲ key hashes here: owner B, then C, A  (= order(key))

One ring holds every configured server. A server that is down is skipped where the walk meets
it: each server's points depend only on its own name and weight, so the order of the others is
the same as on a ring built without it, and its keys go to the next server clockwise and come
back when it does. The ring is immutable; ``set_weights`` builds a new one and swaps the
reference, so a reader never sees a half-built ring.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import NamedTuple

from uhashring import HashRing

DEFAULT_VNODES = 160


class RingPick(NamedTuple):
    url: str


class _Ring:
    """An immutable snapshot: the hash ring over some servers."""

    def __init__(self, weights: Mapping[str, int], vnodes: int) -> None:
        nodes = {u: {"weight": w, "vnodes": vnodes} for u, w in weights.items()}
        self._ring = HashRing(nodes=nodes) if nodes else None

    def walk(self, key: str) -> Iterator[str]:
        """Every server once, clockwise from ``key``'s point (lazily: a pick stops early)."""
        if self._ring is not None:
            for node in self._ring.range(key):
                yield str(node["nodename"])


class HashRingPolicy:
    """A ``RoutingPolicy`` over string keys: the first candidate clockwise from the key."""

    def __init__(self, weights: Mapping[str, int], vnodes: int = DEFAULT_VNODES) -> None:
        """``weights``: url -> capacity weight (a weight 2 server owns ~2x the keys)."""
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.vnodes = vnodes
        self._ring = _Ring({}, vnodes)
        self.set_weights(weights)

    def set_weights(self, weights: Mapping[str, int]) -> None:
        for url, w in weights.items():
            if w < 1:
                raise ValueError(f"ring weight must be >= 1, got {w} for {url}")
        self._ring = _Ring(dict(weights), self.vnodes)

    def order(self, key: str, among: Collection[str]) -> list[str]:
        """The servers of ``among`` in the order the ring meets them from ``key`` (owner first)."""
        return [u for u in self._ring.walk(key) if u in among]

    def choose(self, request: str, candidates: Sequence[str]) -> RingPick:
        among = set(candidates)
        for url in self._ring.walk(request):
            if url in among:
                return RingPick(url)
        raise LookupError(f"none of {list(candidates)} is on the ring")
