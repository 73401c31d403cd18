"""The ingress side of Encode: a MediaSource in, an EmbeddingRef out.

    source ──fetch (aiohttp, SSRF-guarded)──▶ bytes ──sniff──▶ modality
       ──MediaKey (executor for large bodies)──▶ node cache hit? ──yes──▶ ref
       ──no──▶ the shared store (``--store``) has it? ──yes──▶ into the node cache ──▶ ref
       ──no──▶ router: consistent hash of the key picks the worker, single-flight per key,
               retry on the next worker of the ring ──▶ worker decodes, preprocesses, encodes,
               writes the node cache ──▶ ref (fetched into this node's cache if remote)

The event loop only awaits: hashing of large bodies runs in the default executor; decode and the
forward run in the encoder processes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from encoder.caches.embed_cache import EmbedCache
from encoder.caches.embedding_ref import EmbeddingRef
from encoder.caches.embedding_tier import EmbeddingTier
from encoder.caches.media_key import media_key_async
from encoder.serving.router import AllAttemptsFailed, EncoderRouter, NoWorkerAvailable
from epd.encoder_client import EncoderClient
from epd.media_request import MediaSource
from epd.metrics import IngressMetrics
from epd_common.errors import APIError, bad_request, overloaded
from media_io.config import PreprocessConfig
from media_io.errors import MediaError
from media_io.fetch import Fetcher
from media_io.sniff import sniff


@dataclass(frozen=True)
class EncodedItem:
    """One resolved media item of a request."""

    name: str
    ref: EmbeddingRef
    cache_hit: bool
    timings_ms: dict[str, float] = field(default_factory=dict)


class MediaPipeline:
    def __init__(
        self,
        *,
        fetcher: Fetcher,
        router: EncoderRouter,
        cache: EmbedCache,
        client: EncoderClient,
        preprocess: PreprocessConfig,
        fingerprint: str,
        metrics: IngressMetrics,
        max_inflight: int = 256,
        tier: EmbeddingTier | None = None,
    ) -> None:
        self.fetcher = fetcher
        self.router = router
        self.cache = cache
        self.client = client
        self.preprocess = preprocess
        self.fingerprint = fingerprint
        self.metrics = metrics
        self.tier = tier
        # Bounded admission: items beyond this many in flight are refused with 503, not queued.
        self.max_inflight = max_inflight
        self._inflight = 0

    def check_capacity(self) -> None:
        """Refuse early (503) when no item could be admitted, before a request body is parsed."""
        if self._inflight >= self.max_inflight:
            raise overloaded(f"the encoder pipeline is full ({self._inflight} items in flight)")

    async def resolve_all(self, sources: Sequence[MediaSource]) -> list[EncodedItem]:
        """Resolve every item concurrently; the first failure fails the request (others are cancelled)."""
        if self._inflight + len(sources) > self.max_inflight:
            raise overloaded(f"the encoder pipeline is full ({self._inflight} items in flight)")
        self._inflight += len(sources)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self.resolve(src)) for src in sources]
        except* (APIError, MediaError) as eg:
            raise eg.exceptions[0] from None
        finally:
            self._inflight -= len(sources)
        return [t.result() for t in tasks]

    async def resolve(self, src: MediaSource) -> EncodedItem:
        t0 = time.perf_counter()
        data = src.data if src.data is not None else await self.fetcher.fetch(_url(src), item=src.name)
        t_download = time.perf_counter()
        try:
            kind = sniff(data)
        except MediaError as exc:  # sniff sees bytes only; name the item so the client knows which
            raise type(exc)(exc.message, exc.item or src.name) from exc
        if src.modality_hint is not None and kind.modality != src.modality_hint:
            raise bad_request(
                f"{src.name} was sent as {src.modality_hint} but its bytes are {kind.modality} ({kind.format})",
                src.name,
            )
        key = await media_key_async(data, kind.modality, self.preprocess, self.fingerprint)
        t_key = time.perf_counter()
        timings = {"download": (t_download - t0) * 1e3, "hash": (t_key - t_download) * 1e3}

        cached = self.cache.get(key)
        if cached is not None:
            self.metrics.cache_hits.inc()
            timings["total"] = (time.perf_counter() - t0) * 1e3
            return EncodedItem(src.name, cached.ref, True, timings)
        self.metrics.cache_misses.inc()
        if self.tier is not None:  # encoded on another node already? (no worker call then)
            ref = await asyncio.get_running_loop().run_in_executor(None, self.tier.lookup, key)
            if ref is not None:
                self.metrics.store_hits.inc()
                timings["total"] = (time.perf_counter() - t0) * 1e3
                return EncodedItem(src.name, ref, True, timings)
            self.metrics.store_misses.inc()

        async def call(worker_url: str) -> EmbeddingRef:
            reply = await self.client.encode(worker_url, data, kind.modality, src.name)
            timings.update(reply.timings_ms)
            if not self.cache.contains(reply.ref.key):
                # The worker is on another node: bring the bytes into this node's cache.
                ref_url = reply.ref.url or f"{worker_url}/embeddings/{reply.ref.key}"
                tensor = await self.client.fetch_embedding(ref_url)
                self.cache.put(
                    reply.ref.key,
                    tensor,
                    reply.ref.grid_thw,
                    reply.ref.modality,
                    "ingress",
                    reply.ref.seconds_per_grid_t,
                    reply.ref.grid_t_timestamps,
                )
            return reply.ref

        try:
            ref = await self.router.call(key, call)
        except (AllAttemptsFailed, NoWorkerAvailable) as exc:
            raise overloaded(f"no encoder worker could take {src.name}: {exc}", retry_after_s=2.0) from exc
        if ref.key != key:
            raise APIError(
                500, f"encoder returned key {ref.key} for {src.name}, expected {key}", type="internal_error"
            )
        timings["total"] = (time.perf_counter() - t0) * 1e3
        self.metrics.observe_timings(timings)
        self.metrics.media_items.labels(modality=kind.modality).inc()
        return EncodedItem(src.name, ref, False, timings)


def _url(src: MediaSource) -> str:
    assert src.url is not None
    return src.url
