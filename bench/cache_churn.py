"""Worker churn for ``bench.cache_hits``: what each cache design keeps when a worker dies or joins
mid-stream, with the ring routing both.

The stream runs warm up to request ``at``; then one event changes the real EncoderRouter's ring
and the hit rate is measured over the next ``window`` requests:

    death   node0-enc1 leaves the ring (``mark_down``, as a failed health check does). Its keys
            move clockwise: about a third to its node-mate, the rest to node1.
    join    node1-enc2 joins (``set_workers``). It takes about a fifth of the keys, from all four,
            and brings total/4 bytes in both designs (its own cache, or a larger node budget).
    none    nothing happens: the same window without an event, the reference.

A moved key's first request after the event can only hit a cache that its new owner shares with
its old one. Before the event the ring was stable, so only the old owner's cache ever stored the
key: with per-worker caches no first touch of a moved key can hit, and with node caches only the
keys that stayed on their node can. The run counts both, which makes that checkable.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import NamedTuple

from bench.cache_sim import WORKERS, CacheSet, Workload, node_of, serve, worker_url
from epd.encoder_router import EncoderRouter, WorkerSpec

EVENTS = ("none", "death", "join")
VICTIM = worker_url(0, 1)
NEWCOMER = worker_url(1, 2)


class ChurnRun(NamedTuple):
    """One (event, cache design) run, counted over the window after the event."""

    event: str  # "none" | "death" | "join"
    shared: bool  # node caches (True) or per-worker caches
    window: int  # requests after the event that are counted
    hits: int
    moved_keys: int  # keys whose owner the event changed (all keys, requested or not)
    moved_same_node: int  # of them, keys whose new owner is on the old owner's node
    first_touch_same: int  # moved keys requested in the window whose new owner is on the same node
    first_touch_same_hits: int
    first_touch_other: int  # moved keys requested in the window that changed node
    first_touch_other_hits: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.window if self.window else 0.0

    @property
    def first_touches(self) -> int:
        return self.first_touch_same + self.first_touch_other

    @property
    def first_touch_hits(self) -> int:
        return self.first_touch_same_hits + self.first_touch_other_hits


def _apply(event: str, router: EncoderRouter, caches: CacheSet) -> None:
    if event == "death":
        # mark_down logs a warning meant for an operator; here it is the experiment.
        router_log = logging.getLogger("epd.server_pool")
        level = router_log.level
        router_log.setLevel(logging.ERROR)
        try:
            router.mark_down(VICTIM)
        finally:
            router_log.setLevel(level)
        caches.drop(VICTIM)
    elif event == "join":
        router.set_workers([*router.workers, WorkerSpec(NEWCOMER)])
        caches.join(NEWCOMER)
    elif event != "none":
        raise ValueError(f"unknown churn event {event!r}")


def run_churn_case(w: Workload, root: Path, event: str, shared: bool, at: int, window: int) -> ChurnRun:
    router = EncoderRouter([WorkerSpec(u) for u in WORKERS])
    caches = CacheSet(w.total_bytes, shared, root)
    for url in WORKERS:
        caches.add(url)
    try:
        for item in w.stream[:at]:
            key = w.keys[item]
            serve(caches[router.pick(key)], key, int(item), int(w.tokens[item]))
        owner_before = [router.pick(k) for k in w.keys]
        _apply(event, router, caches)
        # key index -> whether its new owner is on its old owner's node, for the keys that moved
        moved: dict[int, bool] = {}
        for i, key in enumerate(w.keys):
            now = router.pick(key)
            if now != owner_before[i]:
                moved[i] = node_of(now) == node_of(owner_before[i])
        hits = 0
        touched: set[int] = set()
        first = {True: [0, 0], False: [0, 0]}  # same node? -> [first touches, hits among them]
        for item in w.stream[at : at + window]:
            i = int(item)
            hit = serve(caches[router.pick(w.keys[i])], w.keys[i], i, int(w.tokens[i]))
            hits += hit
            if i in moved and i not in touched:
                touched.add(i)
                first[moved[i]][0] += 1
                first[moved[i]][1] += hit
        counted = len(w.stream[at : at + window])
        return ChurnRun(
            event,
            shared,
            counted,
            hits,
            len(moved),
            sum(moved.values()),
            first[True][0],
            first[True][1],
            first[False][0],
            first[False][1],
        )
    finally:
        caches.close()


def run_churn(w: Workload, base: Path, at: int, window: int) -> list[ChurnRun]:
    """Every event with both cache designs (the ring routes in all of them)."""
    runs = []
    for event in EVENTS:
        for shared in (True, False):
            root = base / f"churn-{event}-{'node' if shared else 'worker'}"
            runs.append(run_churn_case(w, root, event, shared, at, window))
    return runs
