"""Embedding-cache hit rate: consistent hashing + node-shared caches vs round-robin + per-worker caches.

    python -m bench.cache_hits [--requests 20000] [--media 10000] [--json PATH] [--quick]

A Zipf(alpha) stream of media requests goes to 4 encoder workers on 2 simulated nodes. Every
configuration has the same total cache bytes:

    ring + node cache   (ours)   the ring sends a key to one worker; the 2 workers of a node
                                 share one EmbedCache of total/2 bytes
    rr + worker cache   (base)   round-robin; each worker has its own EmbedCache of total/4
    ring + worker cache          attribution: routing alone
    rr + node cache              attribution: sharing alone

Everything is real but the encode: the real MediaKey, the real EncoderRouter ring and real
EmbedCache directories (temporary roots), so eviction, headers and the byte budget all apply.
A miss "encodes" by writing a deterministic tensor. Round-robin spreads each key over every
worker, so each small cache holds copies of the same popular items; the ring partitions keys,
so the whole budget holds distinct items.

A second part times reading one cached 1 MiB embedding (get + touch every page via sum) against
a copying read of the same file and against summing an in-memory tensor.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from bench.common import (
    add_common_args,
    format_machine,
    machine_info,
    percentiles,
    print_table,
    timed_runs,
    write_json,
)
from encoder.embed_cache import EmbedCache
from encoder.media_key import media_key
from encoder.router import EncoderRouter, WorkerSpec
from media_io.config import PreprocessConfig

WORKERS = [f"http://node{n}-enc{w}:8001" for n in range(2) for w in range(2)]
NODE_OF = {url: i // 2 for i, url in enumerate(WORKERS)}
HIDDEN = 128  # float16 embeddings: 256 B per token


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


def zipf_stream(n_media: int, n_requests: int, alpha: float, seed: int) -> np.ndarray:
    """Item ids drawn with P(rank k) ~ 1 / k^alpha (ranks shuffled over the ids)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_media + 1, dtype=np.float64) ** alpha
    ranks = rng.choice(n_media, size=n_requests, p=p / p.sum())
    return rng.permutation(n_media)[ranks]


def item_tokens(n_media: int, seed: int) -> np.ndarray:
    """Tokens per item: images of 64..1024 tokens (log-uniform), as a Qwen2-VL mix would give."""
    rng = np.random.default_rng(seed + 1)
    return np.exp(rng.uniform(np.log(64), np.log(1024), size=n_media)).astype(np.int64)


def simulate(
    name: str,
    keys: list[str],
    tokens: np.ndarray,
    stream: np.ndarray,
    route: Callable[[int, str], str],
    cache_for: Callable[[str], EmbedCache],
) -> SimResult:
    hits = encodes = 0
    t0 = time.perf_counter()
    for i, item in enumerate(stream):
        key = keys[item]
        cache = cache_for(route(i, key))
        if cache.get(key) is not None:
            hits += 1
            continue
        encodes += 1
        emb = torch.full((int(tokens[item]), HIDDEN), float(item % 251), dtype=torch.float16)
        cache.put(key, emb, [(1, 2, 2 * int(tokens[item]))], "image")
    seconds = time.perf_counter() - t0
    return SimResult(name, len(stream), hits, encodes, -1, seconds)


def run_hit_rates(args: argparse.Namespace, base: Path) -> list[SimResult]:
    cfg = PreprocessConfig()
    keys = [media_key(f"media-{i}".encode(), "image", cfg, "bench-fingerprint") for i in range(args.media)]
    tokens = item_tokens(args.media, args.seed)
    stream = zipf_stream(args.media, args.requests, args.alpha, args.seed)
    mean_entry = 4096 + float(tokens.mean()) * HIDDEN * 2
    # Every per-worker cache (total / 4) must hold a few of the largest entries, even in tiny runs.
    largest = 4096 + int(tokens.max()) * HIDDEN * 2
    total = max(int(args.cache_fraction * args.media * mean_entry), 4 * 4 * largest)
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
        caches: dict[str, EmbedCache] = {}
        for url in WORKERS:
            group = f"node{NODE_OF[url]}" if shared else url.split("//")[1].split(":")[0]
            if group not in caches:
                budget = total // 2 if shared else total // 4
                caches[group] = EmbedCache("bench", capacity_bytes=budget, root=base / f"cfg{cfg_i}" / group)
            caches[url] = caches[group]

        r = simulate(name, keys, tokens, stream, route, caches.__getitem__)
        evictions = sum(c.stats().evictions for g, c in caches.items() if not g.startswith("http"))
        results.append(r._replace(evictions=evictions))
        for g, c in caches.items():
            if not g.startswith("http"):
                assert c.stats().used_bytes <= c.capacity_bytes
                c.close()
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.media, args.latency_reps = 2000, 1000, 30
    torch.manual_seed(args.seed)
    # One thread: small fills and sums only; a 2-core machine shared with other jobs makes
    # OpenMP's spinning threads the bottleneck otherwise.
    torch.set_num_threads(1)
    base = Path(
        tempfile.mkdtemp(prefix="epd-bench-cache-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    try:
        sims = run_hit_rates(args, base)
        lat = run_read_latency(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    info = machine_info()
    ours, baseline = sims[0], sims[1]
    gain = ours.hit_rate / baseline.hit_rate - 1 if baseline.hit_rate else float("inf")
    print_table(
        f"hit rate: Zipf({args.alpha}) over {args.media} media, {args.requests} requests, 4 workers on 2 nodes",
        ["config", "hit rate", "encodes", "evictions", "vs baseline", "sim s"],
        [
            [r.name, r.hit_rate, r.encodes, r.evictions, r.hit_rate / baseline.hit_rate, r.seconds]
            for r in sims
        ],
        caption=format_machine(info),
    )
    lat_p = {name: percentiles(v) for name, v in lat.items()}
    base_p50 = lat_p["read file into buffer + sum"].p50
    print_table(
        "reading a cached 1 MiB embedding",
        ["path", "P50 ms", "P90 ms", "P99 ms", "P50 vs copy"],
        [[n, p.p50 * 1e3, p.p90 * 1e3, p.p99 * 1e3, p.p50 / base_p50] for n, p in lat_p.items()],
        caption=format_machine(info),
    )
    cached_p = lat_p["cache.get + sum (mmap, zero-copy)"]
    summary = {
        "hit_rate_ours": ours.hit_rate,
        "hit_rate_baseline": baseline.hit_rate,
        "hit_rate_gain": gain,
        "encodes_saved": baseline.encodes - ours.encodes,
        "read_1mib_p50_ms": cached_p.p50 * 1e3,
        "read_1mib_p99_ms": cached_p.p99 * 1e3,
        "read_1mib_p50_vs_copy": cached_p.p50 / base_p50,
    }
    print(f"hit_rate_gain (relative) = {gain:+.1%}")
    write_json(
        args.json,
        summary=summary,
        machine=info,
        config=vars(args),
        results={
            "hit_rates": [{**r._asdict(), "hit_rate": r.hit_rate} for r in sims],
            "read_latency_s": {n: p._asdict() for n, p in lat_p.items()},
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
