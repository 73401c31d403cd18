"""``bench.cache_hits``' store row: 2 nodes x 2 workers that share a Redis below their node caches.

Each node routes within itself (a ring over its own two workers) and a request arrives at either
node (as behind a load balancer that knows nothing of media): without a shared tier, a medium
requested at both nodes is encoded on both. With the store, a node-cache miss asks Redis first
(``EmbeddingTier``: the real lookup, checks and publish) and only a miss there encodes. Same
node-cache bytes in both runs; the store is extra capacity, as it is in a deployment.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np

from bench.cache_sim import Workload, fake_embedding, worker_url
from encoder.caches.embed_cache import EmbedCache
from encoder.caches.embedding_tier import EmbeddingTier
from epd.encoder_router import EncoderRouter, WorkerSpec
from epd_common.store.guarded import GuardedStore
from epd_common.store.local_redis import LocalRedis
from epd_common.store.redis_store import RedisStore


class StoreRow(NamedTuple):
    name: str
    requests: int
    node_hits: int  # answered by the node cache
    store_hits: int  # answered by the shared store (no encode)
    encodes: int

    @property
    def hit_rate(self) -> float:
        return (self.node_hits + self.store_hits) / self.requests


def _run(w: Workload, base: Path, store_url: str | None, seed: int) -> StoreRow:
    rings = [EncoderRouter([WorkerSpec(worker_url(n, i)) for i in range(2)]) for n in range(2)]
    caches = [
        EmbedCache("bench", capacity_bytes=w.total_bytes // 2, root=base / f"node{n}") for n in range(2)
    ]
    store = GuardedStore(RedisStore(store_url)) if store_url else None
    tiers = [EmbeddingTier(store, c) if store else None for c in caches]
    arrivals = np.random.default_rng(seed + 7).integers(0, 2, size=len(w.stream))
    node_hits = store_hits = encodes = 0
    try:
        for item, n in zip(w.stream, arrivals, strict=True):
            key = w.keys[int(item)]
            rings[n].pick(key)  # the worker a miss goes to (its node's cache either way)
            cache, tier = caches[n], tiers[n]
            if cache.get(key) is not None:
                node_hits += 1
            elif tier is not None and tier.lookup(key) is not None:
                store_hits += 1
            else:
                encodes += 1
                cache.put(
                    key,
                    fake_embedding(int(item), int(w.tokens[item])),
                    [(1, 2, 2 * int(w.tokens[item]))],
                    "image",
                )
                if tier is not None:
                    tier.publish(key)
    finally:
        for c in caches:
            c.close()
        if store is not None:
            store.close()
    name = "ring per node + node caches + shared Redis" if store_url else "ring per node + node caches alone"
    return StoreRow(name, len(w.stream), node_hits, store_hits, encodes)


def run_store_rows(w: Workload, base: Path, seed: int) -> list[StoreRow] | None:
    """Both rows, with a fresh ``redis-server`` on loopback; None when it is not installed."""
    if shutil.which("redis-server") is None:
        return None
    alone = _run(w, base / "alone", None, seed)
    with LocalRedis(maxmemory_bytes=max(64 << 20, 2 * w.total_bytes)) as server:
        shared = _run(w, base / "shared", server.url, seed)
    return [alone, shared]
