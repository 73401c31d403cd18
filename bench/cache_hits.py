"""Embedding-cache hit rate: consistent hashing + node-shared caches vs round-robin + per-worker caches.

    python -m bench.cache_hits [--requests 20000] [--media 10000] [--round-trip-reps 200]
                               [--json PATH] [--quick]

A Zipf(alpha) stream of media requests goes to 4 encoder workers on 2 simulated nodes. Every
configuration has the same total cache bytes:

    ring + node cache   (ours)   the ring sends a key to one worker; the 2 workers of a node
                                 share one EmbedCache of total/2 bytes
    rr + worker cache   (base)   round-robin; each worker has its own EmbedCache of total/4
    ring + worker cache          attribution: routing alone
    rr + node cache              attribution: sharing alone

In a steady stream the gain is the ring's: round-robin spreads each key over every worker, so
each small cache holds copies of the same popular items, while the ring partitions keys, so the
whole budget holds distinct items, and once keys are partitioned a node cache of total/2 over two
workers' keys holds what two total/4 caches hold. The node cache's own value shows elsewhere, and
the benchmark measures it too:

    churn     a worker dies / joins mid-stream (the real router's mark_down / set_workers): the
              hit rate over the next requests, node caches vs per-worker caches (cache_churn.py)
    ingress   the real MediaPipeline serves the stream: the share of requests the ingress answers
              from its node cache without calling a worker, and the time of such a hit against a
              real worker's round trip on loopback (cache_ingress.py). The ingress also copies
              remote workers' embeddings into its node's cache, so end to end fewer requests
              skip the encode than the worker-only "ring + node cache" row says; both are printed.

Real: MediaKeys, the EncoderRouter ring, EmbedCache directories on tmpfs (eviction, headers and
the byte budget all apply), the ingress pipeline, and in the round trip an `epd encoder` process.
Simulated: the encode (a miss writes a deterministic tensor of the item's size), the workers
behind the stream's pipeline (no HTTP) and the transfer of a remote embedding.

A last part times reading one cached 1 MiB embedding (get + touch every page via sum) against a
copying read of the same file and against summing an in-memory tensor.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from bench.cache_churn import run_churn
from bench.cache_ingress import run_ingress_stream, time_round_trip
from bench.cache_report import churn_summary, print_churn, print_ingress, print_round_trip
from bench.cache_sim import (
    WORKERS,
    CacheSet,
    Workload,
    item_tokens,
    make_workload,
    serve,
    zipf_stream,
)
from bench.cache_store import run_store_rows
from bench.common import (
    add_common_args,
    format_machine,
    machine_info,
    percentiles,
    print_table,
    timed_runs,
    write_json,
)
from encoder.caches.embed_cache import EmbedCache
from epd.encoder_router import EncoderRouter, WorkerSpec

__all__ = ["item_tokens", "main", "zipf_stream"]  # the stream helpers moved to cache_sim.py


class SimResult(NamedTuple):
    name: str
    requests: int
    hits: int
    encodes: int
    evictions: int
    seconds: float

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests


class Attribution(NamedTuple):
    """Where the gain over the baseline comes from (relative hit-rate gains)."""

    total: float  # ring + node cache vs the baseline
    routing_alone: float  # ring + worker caches vs the baseline
    sharing_alone: float  # round-robin + node cache vs the baseline
    sharing_on_ring: float  # ring + node cache vs ring + worker caches
    routing_share: float  # share of the gained hit-rate points that routing alone reaches


def attribute(sims: list[SimResult]) -> Attribution:
    ours, base, ring_w, rr_node = (r.hit_rate for r in sims)

    def rel(a: float, b: float) -> float:
        return a / b - 1 if b else float("inf")

    gained = ours - base
    return Attribution(
        total=rel(ours, base),
        routing_alone=rel(ring_w, base),
        sharing_alone=rel(rr_node, base),
        sharing_on_ring=rel(ours, ring_w),
        routing_share=(ring_w - base) / gained if gained else float("nan"),
    )


def simulate(w: Workload, route: Callable[[int, str], str], caches: CacheSet) -> tuple[int, float]:
    """Hits and seconds for ``w``'s stream routed by ``route``."""
    hits = 0
    t0 = time.perf_counter()
    for i, item in enumerate(w.stream):
        key = w.keys[item]
        hits += serve(caches[route(i, key)], key, int(item), int(w.tokens[item]))
    return hits, time.perf_counter() - t0


def run_hit_rates(w: Workload, base: Path) -> list[SimResult]:
    router = EncoderRouter([WorkerSpec(u) for u in WORKERS])

    def ring(i: int, key: str) -> str:
        return router.pick(key)

    def round_robin(i: int, key: str) -> str:
        return WORKERS[i % len(WORKERS)]

    results = []
    for cfg_i, (name, route, shared) in enumerate(
        [
            ("ring + node cache (ours)", ring, True),
            ("rr + worker cache (baseline)", round_robin, False),
            ("ring + worker cache", ring, False),
            ("rr + node cache", round_robin, True),
        ]
    ):
        caches = CacheSet(w.total_bytes, shared, base / f"cfg{cfg_i}")
        for url in WORKERS:
            caches.add(url)
        try:
            hits, seconds = simulate(w, route, caches)
            n = len(w.stream)
            results.append(SimResult(name, n, hits, n - hits, caches.evictions(), seconds))
        finally:
            caches.close()
    return results


def run_read_latency(args: argparse.Namespace, base: Path) -> dict[str, list[float]]:
    cache = EmbedCache("bench-lat", capacity_bytes=64 << 20, root=base / "latency")
    t = torch.randn(1024, 256)  # [tokens, hidden] float32 = 1 MiB
    cache.put("one-mib", t, [(1, 64, 64)], "image")
    path = cache.root / "entries" / "one-mib"
    header_len = os.path.getsize(path) - t.numel() * 4
    reps = args.latency_reps

    def cached() -> None:
        got = cache.get("one-mib")
        assert got is not None
        got.tensor.sum()  # touches every page of the mapping

    buf = bytearray(os.path.getsize(path))  # reused: the baseline pays the copy, not page faults

    def copying() -> None:
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)
        torch.frombuffer(buf, dtype=torch.float32, offset=header_len).sum()

    def in_memory() -> None:
        t.sum()

    out = {
        "cache.get + sum (mmap, zero-copy)": timed_runs(cached, reps, warmup=5),
        "read file into buffer + sum": timed_runs(copying, reps, warmup=5),
        "in-memory tensor sum": timed_runs(in_memory, reps, warmup=5),
    }
    cache.close()
    return out


def print_hit_rates(args: argparse.Namespace, sims: list[SimResult], a: Attribution, machine: str) -> None:
    ours, baseline, ring_w, rr_node = sims
    caption = (
        f"Where the {a.total:+.1%} comes from: routing alone ({ring_w.name}) {a.routing_alone:+.1%}; "
        f"sharing alone ({rr_node.name}) {a.sharing_alone:+.1%}; the node cache on top of the ring "
        f"{a.sharing_on_ring:+.1%} ({ours.hit_rate:.3f} vs {ring_w.hit_rate:.3f}). Routing reaches "
        f"{a.routing_share:.0%} of the gained hit-rate points: in a steady stream the gain is the "
        "ring's. The node cache's own value is under churn and at the ingress (below).\n" + machine
    )
    print_table(
        f"hit rate: Zipf({args.alpha}) over {args.media} media, {args.requests} requests, 4 workers on 2 nodes",
        ["config", "hit rate", "encodes", "evictions", "vs baseline", "sim s"],
        [
            [r.name, r.hit_rate, r.encodes, r.evictions, r.hit_rate / baseline.hit_rate, r.seconds]
            for r in sims
        ],
        caption=caption,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--media", type=int, default=10000, help="distinct media items")
    parser.add_argument("--alpha", type=float, default=1.0, help="Zipf exponent")
    parser.add_argument(
        "--cache-fraction",
        type=float,
        default=0.05,
        help="total cache bytes as a fraction of all items' bytes",
    )
    parser.add_argument("--latency-reps", type=int, default=300)
    parser.add_argument(
        "--round-trip-reps",
        type=int,
        default=200,
        help="rounds of ingress hit vs worker round trip (starts one `epd encoder`; 0 skips it)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.media, args.latency_reps = 2000, 1000, 30
        args.round_trip_reps = min(args.round_trip_reps, 20)
    torch.manual_seed(args.seed)
    # One thread: small fills and sums only; a 2-core machine shared with other jobs makes
    # OpenMP's spinning threads the bottleneck otherwise.
    torch.set_num_threads(1)
    # Churn: warm over the first half of the stream, count the next quarter.
    churn_at, churn_window = args.requests // 2, max(args.requests // 4, 1)
    base = Path(
        tempfile.mkdtemp(prefix="epd-bench-cache-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    try:
        w = make_workload(args.media, args.requests, args.alpha, args.seed, args.cache_fraction)
        sims = run_hit_rates(w, base)
        churn = run_churn(w, base, churn_at, churn_window)
        ingress = run_ingress_stream(w, base / "ingress")
        rt = time_round_trip(base, args.round_trip_reps, args.seed) if args.round_trip_reps > 0 else None
        lat = run_read_latency(args, base)
        store_rows = run_store_rows(w, base / "store", args.seed)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    info = machine_info()
    machine = format_machine(info)
    ours, baseline = sims[0], sims[1]
    a = attribute(sims)
    print_hit_rates(args, sims, a, machine)
    print_churn(churn, churn_at, machine)
    print_ingress(ingress, ours.hit_rate, baseline.hit_rate, machine)
    if rt is not None:
        print_round_trip(rt, machine)
    lat_p = {name: percentiles(v) for name, v in lat.items()}
    base_p50 = lat_p["read file into buffer + sum"].p50
    print_table(
        "reading a cached 1 MiB embedding",
        ["path", "P50 ms", "P90 ms", "P99 ms", "P50 vs copy"],
        [[n, p.p50 * 1e3, p.p90 * 1e3, p.p99 * 1e3, p.p50 / base_p50] for n, p in lat_p.items()],
        caption=machine,
    )
    if store_rows is not None:
        print_table(
            "2 nodes x 2 workers, a ring per node, each request at either node: a shared store below the node caches",
            ["configuration", "requests", "node-cache hits", "store hits", "encodes", "hit rate"],
            [[r.name, r.requests, r.node_hits, r.store_hits, r.encodes, r.hit_rate] for r in store_rows],
            caption=machine,
        )
    cached_p = lat_p["cache.get + sum (mmap, zero-copy)"]
    summary: dict[str, Any] = {
        "hit_rate_ours": ours.hit_rate,
        "hit_rate_baseline": baseline.hit_rate,
        "hit_rate_gain": a.total,
        "encodes_saved": baseline.encodes - ours.encodes,
        "hit_rate_ring_worker_cache": sims[2].hit_rate,
        "hit_rate_rr_node_cache": sims[3].hit_rate,
        "attribution": a._asdict(),
        "churn": churn_summary(churn, churn_at),
        "ingress_hit_fraction": ingress.ingress_hit_fraction,
        "ingress": {
            **ingress._asdict(),
            "worker_hit_fraction": ingress.worker_hit_fraction,
            "no_encode_fraction": ingress.no_encode_fraction,
            "no_encode_gain_vs_baseline": ingress.no_encode_fraction / baseline.hit_rate - 1,
        },
        "read_1mib_p50_ms": cached_p.p50 * 1e3,
        "read_1mib_p99_ms": cached_p.p99 * 1e3,
        "read_1mib_p50_vs_copy": cached_p.p50 / base_p50,
    }
    if store_rows is not None:
        alone, shared = store_rows
        summary["store"] = {
            "hit_rate_node_caches_alone": alone.hit_rate,
            "hit_rate_with_shared_store": shared.hit_rate,
            "hit_rate_gain": shared.hit_rate / alone.hit_rate - 1,
            "store_hits": shared.store_hits,
            "encodes_saved": alone.encodes - shared.encodes,
        }
    if rt is not None:
        summary["round_trip"] = {
            "body_bytes": rt.body_bytes,
            "ingress_hit_p50_ms": rt.ingress_hit_s.p50 * 1e3,
            "worker_round_trip_p50_ms": rt.worker_hit_s.p50 * 1e3,
            "worker_vs_ingress_p50": rt.worker_hit_s.p50 / rt.ingress_hit_s.p50,
        }
    print(
        f"hit_rate_gain (relative) = {a.total:+.1%}: routing alone {a.routing_alone:+.1%}, "
        f"the node cache on top of the ring {a.sharing_on_ring:+.1%}; "
        f"ingress_hit_fraction = {ingress.ingress_hit_fraction:.3f}"
    )
    write_json(
        args.json,
        summary=summary,
        machine=info,
        config=vars(args),
        results={
            "hit_rates": [{**r._asdict(), "hit_rate": r.hit_rate} for r in sims],
            "churn": [{**r._asdict(), "hit_rate": r.hit_rate} for r in churn],
            "read_latency_s": {n: p._asdict() for n, p in lat_p.items()},
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
