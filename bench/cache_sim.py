"""The simulated deployment behind ``bench.cache_hits``: a Zipf stream of media over 4 encoder
workers on 2 nodes, with real MediaKeys, the real EncoderRouter ring and real EmbedCache
directories; only the encode is simulated (a miss writes a deterministic tensor of the item's size).

``CacheSet`` builds either cache design over the same total bytes and follows workers that leave
or join: a per-worker cache lives and dies with its worker, a node cache belongs to the node.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from encoder.caches.embed_cache import EmbedCache
from encoder.caches.media_key import media_key
from media_io.config import PreprocessConfig

HIDDEN = 128  # float16 embeddings: 256 B per token
FINGERPRINT = "bench-fingerprint"
HEADER_BYTES = 4096  # an entry's header is well under this; only used to size the budget
# JPEG start-of-image: the ingress sniffs bytes before it hashes them, so the synthetic media must
# look like an image (nothing decodes them: the encode is simulated).
JPEG_SOI = b"\xff\xd8\xff\xe0"


def worker_url(node: int, index: int) -> str:
    return f"http://node{node}-enc{index}:8001"


WORKERS = [worker_url(n, w) for n in range(2) for w in range(2)]


def node_of(url: str) -> int:
    """The node a simulated worker URL names (``http://node1-enc0:8001`` -> 1)."""
    host = url.split("//", 1)[1]
    return int(host.split("-", 1)[0].removeprefix("node"))


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


def media_body(item: int) -> bytes:
    """The bytes of item ``item``: distinct per item, sniffed as a JPEG."""
    return JPEG_SOI + f"media-{item}".encode()


class Workload(NamedTuple):
    keys: list[str]  # MediaKey of each item
    tokens: np.ndarray  # embedding tokens of each item
    stream: np.ndarray  # item id of each request
    total_bytes: int  # cache bytes of every configuration, all nodes together


def make_workload(n_media: int, n_requests: int, alpha: float, seed: int, cache_fraction: float) -> Workload:
    cfg = PreprocessConfig()
    keys = [media_key(media_body(i), "image", cfg, FINGERPRINT) for i in range(n_media)]
    tokens = item_tokens(n_media, seed)
    stream = zipf_stream(n_media, n_requests, alpha, seed)
    mean_entry = HEADER_BYTES + float(tokens.mean()) * HIDDEN * 2
    # Every per-worker cache (total / 4) must hold a few of the largest entries, even in tiny runs.
    largest = HEADER_BYTES + int(tokens.max()) * HIDDEN * 2
    total = max(int(cache_fraction * n_media * mean_entry), 4 * 4 * largest)
    return Workload(keys, tokens, stream, total)


def fake_embedding(item: int, tokens: int) -> torch.Tensor:
    """What a simulated encode produces: the item's size, a value that identifies it."""
    return torch.full((tokens, HIDDEN), float(item % 251), dtype=torch.float16)


def serve(cache: EmbedCache, key: str, item: int, tokens: int) -> bool:
    """One request at a worker: a hit, or an encode that lands in ``cache``. True on a hit."""
    if cache.get(key) is not None:
        return True
    cache.put(key, fake_embedding(item, tokens), [(1, 2, 2 * tokens)], "image")
    return False


class CacheSet:
    """The caches of one configuration. ``shared``: one EmbedCache per node (total/2 each) that
    every worker of the node uses; else one per worker (total/4 each)."""

    def __init__(self, total_bytes: int, shared: bool, root: Path) -> None:
        self.total_bytes = total_bytes
        self.shared = shared
        self.root = root
        self._by_group: dict[str, EmbedCache] = {}
        self._by_worker: dict[str, EmbedCache] = {}
        self._closed_evictions = 0  # evictions of per-worker caches already gone with their worker

    def _group(self, url: str) -> str:
        return f"node{node_of(url)}" if self.shared else url.split("//", 1)[1].split(":", 1)[0]

    def add(self, url: str) -> EmbedCache:
        """A worker starts: with per-worker caches it brings a new, empty one of total/4; with node
        caches it uses its node's (created on the node's first worker)."""
        group = self._group(url)
        cache = self._by_group.get(group)
        if cache is None:
            budget = self.total_bytes // 2 if self.shared else self.total_bytes // 4
            cache = EmbedCache("bench", capacity_bytes=budget, root=self.root / group)
            self._by_group[group] = cache
        self._by_worker[url] = cache
        return cache

    def join(self, url: str) -> EmbedCache:
        """A worker joins a running deployment and brings total/4 bytes in either design: its own
        per-worker cache, or that much more budget for its node's cache (equal bytes keep the
        comparison about the design, not the memory)."""
        grows = self.shared and f"node{node_of(url)}" in self._by_group
        cache = self.add(url)
        if grows:
            # The budget lives in the node's shared index: a handle opened with a capacity sets it
            # for every handle, as a restarted service with a larger --cache-capacity-bytes would.
            EmbedCache(
                "bench", capacity_bytes=cache.capacity_bytes + self.total_bytes // 4, root=cache.root
            ).close()
        return cache

    def drop(self, url: str) -> None:
        """A worker dies: its per-worker cache (its memory) goes with it; a node cache stays."""
        cache = self._by_worker.pop(url)
        if not self.shared:
            group = self._group(url)
            self._closed_evictions += cache.stats().evictions
            cache.close()
            del self._by_group[group]
            shutil.rmtree(self.root / group, ignore_errors=True)

    def __getitem__(self, url: str) -> EmbedCache:
        return self._by_worker[url]

    def node_cache(self, node: int) -> EmbedCache:
        assert self.shared, "per-worker configurations have no node cache"
        return self._by_group[f"node{node}"]

    def evictions(self) -> int:
        return self._closed_evictions + sum(c.stats().evictions for c in self._by_group.values())

    def close(self) -> None:
        for cache in self._by_group.values():
            # The byte budget is the design's promise; check it held over the whole run.
            assert cache.stats().used_bytes <= cache.capacity_bytes
            cache.close()
        self._by_group.clear()
        self._by_worker.clear()
