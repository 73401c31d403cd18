"""Tables and summary entries of ``bench.cache_hits`` for churn, the ingress stream and the
round trip (the steady hit-rate table stays with the simulation in cache_hits.py)."""

from __future__ import annotations

from typing import Any

from bench.cache_churn import NEWCOMER, VICTIM, ChurnRun
from bench.cache_ingress import IngressStream, RoundTrip
from bench.common import print_table


def _host(url: str) -> str:
    return url.split("//", 1)[1].split(":", 1)[0]


def _churn_by(runs: list[ChurnRun]) -> dict[tuple[str, bool], ChurnRun]:
    return {(r.event, r.shared): r for r in runs}


def print_churn(runs: list[ChurnRun], at: int, machine: str) -> None:
    by = _churn_by(runs)
    rows: list[list[object]] = []
    for event, what in (("death", f"{_host(VICTIM)} dies"), ("join", f"{_host(NEWCOMER)} joins")):
        for shared in (True, False):
            r, ref = by[(event, shared)], by[("none", shared)]
            rows.append(
                [
                    what,
                    "node cache" if shared else "per-worker caches",
                    r.hit_rate,
                    ref.hit_rate,
                    r.hit_rate - ref.hit_rate,
                    f"{r.first_touch_same} / {r.first_touch_other}",
                    f"{r.first_touch_same_hits} / {r.first_touch_other_hits}",
                ]
            )
    window = by[("none", True)].window
    # How much of the difference is entries kept vs bytes kept: a kept entry shows as a hit on
    # the first request of a moved key (impossible with per-worker caches, see cache_churn.py).
    split = "; ".join(
        f"{event}: {by[(event, True)].hits - by[(event, False)].hits:+d} hits with the node cache, "
        f"{by[(event, True)].first_touch_hits} of them first requests of moved keys"
        for event in ("death", "join")
    )
    caption = (
        "Both designs route by the ring and start with the same bytes. A dying worker's per-worker "
        "cache goes with it (3/4 of the bytes remain); the node cache keeps its entries, so the keys "
        "that move to the node-mate still hit. A joining worker brings total/4 bytes in both designs "
        "(an empty per-worker cache, or a larger node budget); with the node cache, the keys it "
        "takes from its own node's workers are already there. Keys that change node miss in both "
        f"designs: no cache there ever held them. Over the window, {split} (the rest: after a death the node keeps the dead "
        "worker's bytes; after a join, one LRU over the node's workers).\n" + machine
    )
    print_table(
        f"worker churn at request {at}: hit rate over the next {window} requests (ring routing)",
        [
            "event",
            "caches",
            "hit rate",
            "no event",
            "change",
            "moved keys requested (same node / other)",
            "hits on their first request",
        ],
        rows,
        caption=caption,
    )


def print_ingress(s: IngressStream, ours_rate: float, baseline_rate: float, machine: str) -> None:
    """``ours_rate``/``baseline_rate``: the steady worker-only hit rates of ring + node cache and
    of the baseline, to set the pipeline's numbers against."""
    n = s.requests
    rows: list[list[object]] = [
        ["answered by the ingress from node0's cache (no worker call)", s.ingress_hits, s.ingress_hits / n],
        [
            "worker call to node0, answered from the cache (the ingress just missed there)",
            s.local_hits,
            s.local_hits / n,
        ],
        ["worker call to node1, answered from node1's cache", s.remote_hits, s.remote_hits / n],
        ["worker call, encoded (simulated)", s.encodes, s.encodes / n],
        ["remote embeddings copied into node0's cache", s.copies, s.copies / n],
    ]
    caption = (
        f"Real MediaPipeline.resolve, router and caches over the same stream; ingress on node0 as "
        f"`epd serve` runs it; simulated workers (no HTTP). Requests that needed no encode: "
        f"{s.no_encode_fraction:.3f}, {s.no_encode_fraction / baseline_rate - 1:+.1%} vs the "
        f"baseline's {baseline_rate:.3f} (the worker-only simulation's ring + node cache: {ours_rate:.3f}; "
        "the ingress also keeps copies of node1's embeddings in node0's cache, so the bytes hold "
        "fewer distinct items). With per-worker caches the ingress has no cache to look in: every "
        f"request calls a worker. Simulated in {s.seconds:.1f} s.\n" + machine
    )
    print_table(
        "the ingress answers hits without a worker", ["outcome", "requests", "fraction"], rows, caption
    )


def print_round_trip(rt: RoundTrip, machine: str) -> None:
    base = rt.ingress_hit_s.p50
    rows = [
        [name, p.p50 * 1e3, p.p90 * 1e3, p.p99 * 1e3, p.p50 / base]
        for name, p in (
            ("ingress: MediaPipeline.resolve, node-cache hit", rt.ingress_hit_s),
            ("worker: POST /encode round trip, worker's cache hit", rt.worker_hit_s),
        )
    ]
    caption = (
        f"A {rt.body_bytes / 1024:.0f} KiB JPEG; one real `epd encoder` worker on loopback sharing the "
        f"tmpfs node cache; {rt.ingress_hit_s.n} alternating rounds. The ingress hashes the body in "
        "both designs (the ring needs the key), so the round trip is what answering a hit at a "
        "worker adds; a worker on another node adds the network and the embedding's transfer.\n" + machine
    )
    print_table(
        "a hit answered at the ingress vs a worker round trip",
        ["path", "P50 ms", "P90 ms", "P99 ms", "P50 vs ingress"],
        rows,
        caption=caption,
    )


def churn_summary(runs: list[ChurnRun], at: int) -> dict[str, Any]:
    by = _churn_by(runs)

    def one(r: ChurnRun) -> dict[str, Any]:
        ref = by[("none", r.shared)]
        return {
            "hit_rate": r.hit_rate,
            "no_event_hit_rate": ref.hit_rate,
            "moved_keys": r.moved_keys,
            "moved_same_node": r.moved_same_node,
            "first_touches_same_node": r.first_touch_same,
            "first_touch_hits_same_node": r.first_touch_same_hits,
            "first_touches_other_node": r.first_touch_other,
            "first_touch_hits_other_node": r.first_touch_other_hits,
        }

    out: dict[str, Any] = {"event_at": at, "window": by[("none", True)].window}
    for event, worker in (("death", VICTIM), ("join", NEWCOMER)):
        out[event] = {
            "worker": _host(worker),
            "node_cache": one(by[(event, True)]),
            "worker_cache": one(by[(event, False)]),
        }
    return out
