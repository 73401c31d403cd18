"""The ingress side of ``bench.cache_hits``: hits the ingress answers from its node cache without
calling a worker, and what such a hit costs against a worker round trip.

Stream (``run_ingress_stream``): the real ``MediaPipeline.resolve`` (sniff, MediaKey, node-cache
lookup before routing, the real EncoderRouter with single-flight, the copy of a remote worker's
embedding into the ingress's node cache) serves the Zipf stream. The ingress runs on node0, as
``epd serve`` runs it (local workers share its node cache; node1's workers are remote). Only the
workers are simulated (``SimWorkers``: no HTTP; a worker looks in its node's real EmbedCache and
"encodes" on a miss), and so is the transfer of a remote embedding (read from node1's cache).

Round trip (``time_round_trip``): one real ``epd encoder`` process (the embedded default model)
on loopback, sharing a tmpfs node cache with an in-process ingress pipeline. After one real encode,
each round times ``MediaPipeline.resolve`` (a hit answered at the ingress) and a ``POST /encode``
to the worker through the real EncoderClient (the worker's own cache hit).
"""

from __future__ import annotations

import asyncio
import io
import sys
import time
from pathlib import Path
from typing import NamedTuple

import aiohttp
import numpy as np
import torch
from PIL import Image

from bench.cache_sim import FINGERPRINT, WORKERS, CacheSet, Workload, fake_embedding, media_body, node_of
from bench.common import Percentiles, percentiles
from bench.service_proc import ServiceProcess, free_port
from encoder.caches.embed_cache import EmbedCache
from epd.encoder_client import EncoderClient
from epd.encoder_router import EncoderRouter, WorkerSpec
from epd.media_pipeline import MediaPipeline
from epd.media_request import MediaSource
from epd.metrics import IngressMetrics
from epd_common.messages.encode_reply import EncodeReply
from media_io.config import PreprocessConfig
from media_io.fetch import Fetcher

INGRESS_NODE = 0


class IngressStream(NamedTuple):
    requests: int
    ingress_hits: int  # answered by the ingress's node-cache lookup: no worker call
    local_calls: int  # worker calls to node0 (the ingress's node)
    local_hits: int  # of them, answered from the cache (the ingress had just missed it there)
    remote_calls: int  # worker calls to node1
    remote_hits: int  # of them, answered from node1's cache
    encodes: int  # worker calls that encoded (simulated)
    copies: int  # remote embeddings copied into node0's cache by the ingress
    seconds: float

    @property
    def ingress_hit_fraction(self) -> float:
        return self.ingress_hits / self.requests

    @property
    def worker_hit_fraction(self) -> float:
        return (self.local_hits + self.remote_hits) / self.requests

    @property
    def no_encode_fraction(self) -> float:
        return 1.0 - self.encodes / self.requests


class SimWorkers(EncoderClient):
    """The encoder workers behind the pipeline, without HTTP: a worker answers from its node's
    cache or "encodes" into it, as ``EncoderWorker.encode`` does."""

    def __init__(self, w: Workload, caches: CacheSet) -> None:
        # No aiohttp session: nothing leaves the process. The methods the pipeline calls are
        # overridden below.
        self.caches = caches
        self.w = w
        # Stands in for the worker's own hash of the body (it yields the same MediaKey).
        self.item_of_body = {media_body(i): i for i in range(len(w.keys))}
        self.calls = {0: 0, 1: 0}  # node -> worker calls
        self.hits = {0: 0, 1: 0}
        self.encodes = 0
        self.copies = 0

    async def encode(
        self,
        worker_url: str,
        data: bytes,
        modality: str,
        item: str,
        deadline_s: float | None = None,
        track: bool = False,
    ) -> EncodeReply:
        i = self.item_of_body[data]
        key = self.w.keys[i]
        node = node_of(worker_url)
        cache = self.caches[worker_url]
        self.calls[node] += 1
        hit = cache.get(key)
        if hit is not None:
            self.hits[node] += 1
            ref = hit.ref
        else:
            self.encodes += 1
            tokens = int(self.w.tokens[i])
            ref = cache.put(key, fake_embedding(i, tokens), [(1, 2, 2 * tokens)], modality)
        return EncodeReply(ref, hit is not None)

    async def fetch_embedding(self, ref_url: str) -> torch.Tensor:
        worker, key = ref_url.rsplit("/embeddings/", 1)
        got = self.caches[worker].get(key)
        assert got is not None, f"{ref_url}: the worker just wrote it"
        self.copies += 1
        return got.tensor


def run_ingress_stream(w: Workload, root: Path) -> IngressStream:
    caches = CacheSet(w.total_bytes, shared=True, root=root)
    for url in WORKERS:
        caches.add(url)
    # The ingress is another process on node0 in a deployment: its own handle on node0's cache.
    ingress_cache = EmbedCache("bench", root=caches.node_cache(INGRESS_NODE).root, writer="ingress")
    workers = SimWorkers(w, caches)
    pipeline = MediaPipeline(
        fetcher=Fetcher(),  # never started: every item carries its bytes
        router=EncoderRouter([WorkerSpec(u) for u in WORKERS]),
        cache=ingress_cache,
        client=workers,
        preprocess=PreprocessConfig(),
        fingerprint=FINGERPRINT,
        metrics=IngressMetrics(),
    )

    async def run_all() -> int:
        hits = 0
        for n, item in enumerate(w.stream):
            i = int(item)
            got = await pipeline.resolve(MediaSource(name=f"items[{n}]", data=media_body(i)))
            assert got.ref.key == w.keys[i]
            hits += got.cache_hit
        return hits

    t0 = time.perf_counter()
    try:
        ingress_hits = asyncio.run(run_all())
    finally:
        ingress_cache.close()
        caches.close()
    return IngressStream(
        requests=len(w.stream),
        ingress_hits=ingress_hits,
        local_calls=workers.calls[0],
        local_hits=workers.hits[0],
        remote_calls=workers.calls[1],
        remote_hits=workers.hits[1],
        encodes=workers.encodes,
        copies=workers.copies,
        seconds=time.perf_counter() - t0,
    )


class RoundTrip(NamedTuple):
    body_bytes: int
    ingress_hit_s: Percentiles  # MediaPipeline.resolve answered from the node cache
    worker_hit_s: Percentiles  # POST /encode to a worker that finds the entry in the node cache


def photo_jpeg(seed: int, width: int = 640, height: int = 480) -> bytes:
    """A photo-sized JPEG (smooth gradients + noise, so it compresses like a photo, ~10s of KB)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([xx / width * 255, yy / height * 255, (xx + yy) / (width + height) * 255], axis=-1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=90)
    return out.getvalue()


async def _round_trips(url: str, root: Path, reps: int, seed: int) -> RoundTrip:
    body = photo_jpeg(seed)
    cache = EmbedCache("bench-rtt", root=root, writer="ingress")
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            client = EncoderClient(session, timeout_s=120.0)
            health = await client.health(url)
            assert health is not None, f"{url} stopped answering /health"
            pipeline = MediaPipeline(
                fetcher=Fetcher(),
                router=EncoderRouter([WorkerSpec(url)]),
                cache=cache,
                client=client,
                preprocess=PreprocessConfig(),
                fingerprint=str(health["fingerprint"]),
                metrics=IngressMetrics(),
            )
            src = MediaSource(name="photo.jpg", data=body)
            first = await pipeline.resolve(src)  # a real decode + forward; the worker writes the cache
            assert not first.cache_hit, "the node cache was not empty"
            ingress_s: list[float] = []
            worker_s: list[float] = []
            for rep in range(reps + 5):  # alternating, so both see the same machine load
                t0 = time.perf_counter()
                got = await pipeline.resolve(src)
                t1 = time.perf_counter()
                reply = await client.encode(url, body, "image", src.name)
                t2 = time.perf_counter()
                assert got.cache_hit and reply.cache_hit and reply.ref.key == got.ref.key
                if rep >= 5:  # the first rounds warm the connection pool and the executors
                    ingress_s.append(t1 - t0)
                    worker_s.append(t2 - t1)
    finally:
        cache.close()
    return RoundTrip(len(body), percentiles(ingress_s), percentiles(worker_s))


def time_round_trip(base: Path, reps: int, seed: int) -> RoundTrip:
    """Start one real encoder worker on loopback and time both ways of answering a hit."""
    root = base / "rtt-node"
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "epd.cli",
        "encoder",
        "--port",
        str(port),
        "--cache-namespace",
        "bench-rtt",
        "--cache-root",
        str(root),
        "--cache-capacity-bytes",
        str(64 << 20),
        # One thread each: the benchmark's own process shares the cores with it.
        "--torch-threads",
        "1",
        "--forward-streams",
        "1",
        "--decode-threads",
        "1",
    ]
    url = f"http://127.0.0.1:{port}"
    with ServiceProcess("encoder worker", cmd, url, base / "worker.log", ready_path="/health"):
        return asyncio.run(_round_trips(url, root, reps, seed))
