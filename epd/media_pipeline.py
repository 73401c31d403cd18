"""The ingress side of Encode: a MediaSource in, an EmbeddingRef out.

    source ──fetch (aiohttp, SSRF-guarded)──▶ bytes ──sniff──▶ modality
       ──MediaKey (executor for large bodies)──▶ node cache hit? ──yes──▶ ref
       ──no──▶ the shared store (``--store``) has it? ──yes──▶ into the node cache ──▶ ref
       ──no──▶ router: consistent hash of the key picks the worker, single-flight per key,
               retry on the next worker of the ring ──▶ worker decodes, preprocesses, encodes,
               writes the node cache ──▶ ref (fetched into this node's cache if remote)

The event loop only awaits: hashing of large bodies runs in the default executor; decode and the
forward run in the encoder processes.

Audio takes the same path. Its MediaKey folds the audio settings and the audio encoder's
fingerprint the workers report in /health (``AudioKeying``), so it is the key a worker derives;
without one (the encoders have no audio encoder) an audio item is refused with 415.

Admission is by expected wait (``epd_common.admission``), in items: a request's items are taken
while the items in flight plus its own would be done within its deadline at the items per second
this ingress has been resolving (hits included: they are part of the mix it serves). The deadline
travels on: each worker call carries what is left of it (``X-Request-Timeout``), so a worker
refuses an item that would finish too late for the client rather than encode it for nobody. When
every worker of the ring refuses, the 503's Retry-After is the shortest wait they named. A
worker whose last refusal, counted down, is still past a request's deadline is passed by without
being sent the item (``EncoderRouter``), so a refusal costs the workers nothing; while that holds
for every worker, a request is refused before its body is read (the parsing and hashing are most
of what a refused request costs the event loop, which must stay free for ``/health`` and for
the admitted requests).

A chat holds its items in the node cache from here to the engine's answer (``epd.media_lease``):
each item is leased as soon as its ref is known, a request whose items cannot fit the cache
together is refused with 413 at the item that shows it, and a put refused because the cache is
held by other requests' leases is a retryable 503.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from encoder.caches.embed_cache import CacheFull, EmbedCache
from encoder.caches.embedding_tier import EmbeddingTier
from encoder.caches.media_key import media_key_async
from epd.encoder_client import EncoderClient, WorkerCacheFull
from epd.encoder_router import EncoderRouter, WorkerUnavailable
from epd.media_lease import LEASE_MARGIN_S, MediaLease, cache_full
from epd.media_request import MediaSource
from epd.metrics import IngressMetrics
from epd.server_pool import AllAttemptsFailed, NoServerAvailable
from epd_common.admission import (
    Lateness,
    ServiceRate,
    admission_bound_s,
    bound_text,
    near_bound_s,
    seconds_left,
)
from epd_common.errors import APIError, bad_request, overloaded
from epd_common.messages.embedding_ref import EmbeddingRef
from media_io.audio import has_audio_stream
from media_io.audio_settings import AudioSettings
from media_io.config import MediaLimits, PreprocessConfig
from media_io.errors import MediaError, UnsupportedMedia
from media_io.fetch import Fetcher
from media_io.media_seconds import MediaSeconds, declared_media_seconds
from media_io.sniff import MediaKind, sniff


@dataclass(frozen=True)
class AudioKeying:
    """What an audio MediaKey folds in, as the encoder workers report it (/health "audio")."""

    settings: AudioSettings
    fingerprint: str

    @classmethod
    def from_health(cls, audio: object) -> AudioKeying | None:
        """From a worker's /health "audio" value (None: it has no audio encoder)."""
        if not isinstance(audio, dict):
            return None
        return cls(AudioSettings.from_dict(audio["settings"]), str(audio["fingerprint"]))


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
        max_inflight: int = 4096,
        max_queue_wait_s: float = 10.0,
        seed_items_per_s: float = 50.0,
        tier: EmbeddingTier | None = None,
        audio: AudioKeying | None = None,
        limits: MediaLimits = MediaLimits(),
    ) -> None:
        """``max_queue_wait_s``: the deadline of a request that sends none (``X-Request-Timeout``
        shortens it); ``max_inflight``: a memory guard on items at once; ``seed_items_per_s``: the
        rate assumed until measured; ``audio``: how the workers key audio (None: they take none)."""
        self.fetcher = fetcher
        self.router = router
        self.cache = cache
        self.client = client
        self.preprocess = preprocess
        self.fingerprint = fingerprint
        self.metrics = metrics
        self.tier = tier
        self.audio = audio
        self.max_inflight = max_inflight
        self.max_queue_wait_s = max_queue_wait_s
        self.limits = limits  # the request-wide cap on media seconds (the items' own: the workers)
        self.rate = ServiceRate(seed_items_per_s)
        # of requests' media against the wait they were admitted with (learned near the bound: an
        # upload's parse and hash weigh on short waits)
        self.lateness = Lateness(min_estimate_s=near_bound_s(max_queue_wait_s))
        self._inflight = 0

    @property
    def inflight(self) -> int:
        return self._inflight

    def expected_wait_s(self, items: int = 0) -> float:
        """When ``items`` more would be done: the items in flight and theirs at the measured rate
        (unscaled: ``check_capacity`` scales it by how late recent requests were)."""
        return self.rate.expected_wait_s(self._inflight + items)

    def check_capacity(self, items: int = 1, deadline_s: float | None = None) -> None:
        """Refuse (503, Retry-After the expected wait) unless ``items`` more can be taken: done within
        the deadline (an idle pipeline takes any request), and within the memory guard. Called
        before a body is parsed too, so a refused request costs no parsing."""
        deadline = self.max_queue_wait_s if deadline_s is None else deadline_s
        raw = self.expected_wait_s(items)
        wait = self.lateness.scaled(raw)
        self.metrics.expected_wait.set(wait)
        behind = self.router.expected_wait_s()
        if behind > deadline:
            # Every worker refused lately and, counted down, is still past the deadline: refuse
            # before the body is read or hashed. Cache hits are refused too: telling them apart
            # costs the parsing and hashing that refusing early saves the event loop.
            self.metrics.refusals.labels(stage="encoder", reason="wait").inc()
            raise overloaded(
                f"every encoder worker is {behind:.1f} s behind (from its last refusal), past the"
                f" {deadline:g} s deadline",
                retry_after_s=behind,
            )
        bound = admission_bound_s(deadline)  # the answer's way out is not in the estimate
        if self._inflight and wait > bound:
            self.metrics.refusals.labels(stage="ingress", reason="wait").inc()
            raise overloaded(
                f"expected wait {wait:.1f} s ({self._inflight} items in flight and {items} of this request at"
                f" {self.rate.per_s():.1f} items/s, x{wait / raw:.2f} for how late recent requests were)"
                f" exceeds {bound_text(deadline)}",
                retry_after_s=self.lateness.typical(raw),
            )
        if self._inflight + items > self.max_inflight:
            self.metrics.refusals.labels(stage="ingress", reason="memory").inc()
            raise overloaded(
                f"{self._inflight} items in flight; the guard is {self.max_inflight}", retry_after_s=wait
            )

    def lease_for(self, deadline_s: float | None = None) -> MediaLease:
        """A request's hold on its items in the node cache (``resolve_all``'s ``held``), until its
        ``release`` or the deadline plus ``LEASE_MARGIN_S``."""
        deadline = self.max_queue_wait_s if deadline_s is None else deadline_s
        return MediaLease(self.cache, deadline + LEASE_MARGIN_S)

    async def resolve_all(
        self, sources: Sequence[MediaSource], deadline_s: float | None = None, held: MediaLease | None = None
    ) -> list[EncodedItem]:
        """Resolve every item concurrently; the first failure fails the request (others are
        cancelled). ``deadline_s``: the client's (``request_deadline_s``); None: the server's.
        ``held``: each item's entry is leased into it as it resolves (the caller releases it)."""
        deadline = self.max_queue_wait_s if deadline_s is None else deadline_s
        self.check_capacity(len(sources), deadline)
        deadline_at = time.monotonic() + deadline
        token = object()  # this request's media, for the estimate's error
        if self._inflight and self.rate.measured:  # behind other work, at a measured rate
            self.lateness.admitted(token, self.expected_wait_s(len(sources)))
        self._inflight += len(sources)
        downloads: dict[str, asyncio.Task[bytes]] = {}
        seconds = RequestSeconds.of(self.limits)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(self._timed(src, deadline_at, downloads, held, seconds))
                    for src in sources
                ]
            self.lateness.done(token)
        except* (APIError, MediaError) as eg:
            raise eg.exceptions[0] from None
        finally:
            self.lateness.ended(token)
            self._inflight -= len(sources)
        if held is not None:
            held.check()
        return [t.result() for t in tasks]

    async def _timed(
        self,
        src: MediaSource,
        deadline_at: float,
        downloads: dict[str, asyncio.Task[bytes]],
        held: MediaLease | None = None,
        seconds: RequestSeconds | None = None,
    ) -> EncodedItem:
        """``resolve``, counted in the rate admission measures (and, with ``seconds``, in the
        request's media seconds as encoded)."""
        self.rate.started()
        ok = False
        try:
            item = await self.resolve(src, deadline_at, downloads, held, seconds)
            if seconds is not None and not src.audio_track:  # a track lies beside its video's seconds
                seconds.encoded.add(self._encoded_seconds(item.ref), src.name, "as encoded")
            ok = True
            return item
        finally:
            self.rate.finished(ok=ok)

    async def resolve(
        self,
        src: MediaSource,
        deadline_at: float | None = None,
        downloads: dict[str, asyncio.Task[bytes]] | None = None,
        held: MediaLease | None = None,
        seconds: RequestSeconds | None = None,
    ) -> EncodedItem:
        """One item; ``deadline_at`` (monotonic): what is left of it goes to the worker;
        ``downloads``: the request's fetches by URL, so that a video and its sound track (the same
        URL) download once; ``held``: the request's lease, which takes the item's entry;
        ``seconds``: the request's media seconds, which an audio or video item's header adds to
        before any work (a 413 past ``MediaLimits.max_request_media_seconds``)."""
        t0 = time.perf_counter()
        data = src.data if src.data is not None else await self._download(src, downloads)
        t_download = time.perf_counter()
        try:
            kind = sniff(data)
        except MediaError as exc:  # sniff sees bytes only; name the item so the client knows which
            raise type(exc)(exc.message, exc.item or src.name) from exc
        if src.audio_track:
            if kind.modality != "video":
                raise bad_request(f"{src.name} was sent as video but its bytes are {kind.modality}", src.name)
            heard = self.audio is not None and await asyncio.get_running_loop().run_in_executor(
                None, has_audio_stream, data
            )
            if not heard:  # no sound (or no audio encoder): the video is laid out without an audio block
                return EncodedItem(src.name, silent_track(), False, {})
            kind = MediaKind("audio", kind.format)  # the container's audio stream, encoded as audio
        if kind.modality == "audio" and self.audio is None:  # recognized, so the refusal says what
            raise UnsupportedMedia(
                f"audio ({kind.format}) is not supported: the encoders have no audio tower", src.name
            )
        if src.modality_hint is not None and kind.modality != src.modality_hint:
            raise bad_request(
                f"{src.name} was sent as {src.modality_hint} but its bytes are {kind.modality} ({kind.format})",
                src.name,
            )
        if seconds is not None and kind.modality in ("audio", "video") and not src.audio_track:
            declared = await asyncio.get_running_loop().run_in_executor(
                None, declared_media_seconds, data, kind.modality, self.limits, src.name
            )
            seconds.declared.add(declared, src.name)
        if kind.modality == "audio":
            assert self.audio is not None
            settings = self.audio.settings
            if src.audio_track:  # cut to the video's sampled frames, by the worker's own rule
                settings = settings.for_track(self.preprocess)
            key = await media_key_async(data, "audio", settings, self.audio.fingerprint)
        else:
            key = await media_key_async(data, kind.modality, self.preprocess, self.fingerprint)
        t_key = time.perf_counter()
        timings = {"download": (t_download - t0) * 1e3, "hash": (t_key - t_download) * 1e3}

        cached = self.cache.get(key)
        # evicted between the read and the lease: encoded again below
        if cached is not None and (held is None or held.hold(src.name, cached.ref)):
            self.metrics.cache_hits.inc()
            timings["total"] = (time.perf_counter() - t0) * 1e3
            return EncodedItem(src.name, cached.ref, True, timings)
        self.metrics.cache_misses.inc()
        if self.tier is not None:  # encoded on another node already? (no worker call then)
            try:
                ref = await asyncio.get_running_loop().run_in_executor(None, self.tier.lookup, key)
            except CacheFull as exc:  # the copy into this node's cache found it held by leases
                raise _no_room(held, src.name, exc.needed_bytes, exc) from exc
            if ref is not None and (held is None or held.hold(src.name, ref)):
                self.metrics.store_hits.inc()
                timings["total"] = (time.perf_counter() - t0) * 1e3
                return EncodedItem(src.name, ref, True, timings)
            self.metrics.store_misses.inc()

        async def call(worker_url: str) -> EmbeddingRef:
            reply = await self.client.encode(
                worker_url, data, kind.modality, src.name, seconds_left(deadline_at), src.audio_track
            )
            timings.update(reply.timings_ms)
            if not self.cache.contains(reply.ref.key):
                # The worker is on another node: bring the bytes into this node's cache.
                ref_url = reply.ref.url or f"{worker_url}/embeddings/{reply.ref.key}"
                try:
                    tensor = await self.client.fetch_embedding(ref_url)
                except WorkerUnavailable as exc:
                    if exc.status != 404:
                        raise
                    return reply.ref  # evicted before this request could hold it: ``held.lost``
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
            ref = await self.router.call(key, call, seconds_left(deadline_at))
        except AllAttemptsFailed as exc:
            retry = exc.retry_after_s
            if retry is not None:  # refused for load (else: unreachable or failing)
                self.metrics.refusals.labels(stage="encoder", reason="wait").inc()
            raise overloaded(
                f"no encoder worker could take {src.name}: {exc}",
                retry_after_s=2.0 if retry is None else retry,
            ) from exc
        except NoServerAvailable as exc:
            raise overloaded(f"no encoder worker could take {src.name}: {exc}", retry_after_s=2.0) from exc
        except (WorkerCacheFull, CacheFull) as exc:  # the worker's put, or this node's copy of it
            raise _no_room(held, src.name, exc.needed_bytes, exc) from exc
        if ref.key != key:
            raise APIError(
                500, f"encoder returned key {ref.key} for {src.name}, expected {key}", type="internal_error"
            )
        if held is not None and not held.hold(src.name, ref):
            held.lost(src.name, ref)  # evicted between its write and the lease: 503 once all resolved
        timings["total"] = (time.perf_counter() - t0) * 1e3
        self.metrics.observe_timings(timings)
        self.metrics.media_items.labels(modality=kind.modality).inc()
        return EncodedItem(src.name, ref, False, timings)

    def _encoded_seconds(self, ref: EmbeddingRef) -> float:
        """The seconds an encoded item covers: a video's temporal patches, an audio clip's rows."""
        if ref.modality == "video" and ref.seconds_per_grid_t:
            return sum(t for t, _, _ in ref.grid_thw) * ref.seconds_per_grid_t
        if ref.modality == "audio" and self.audio is not None:
            return ref.shape[0] / self.audio.settings.tokens_per_second
        return 0.0

    async def _download(self, src: MediaSource, downloads: dict[str, asyncio.Task[bytes]] | None) -> bytes:
        url = _url(src)
        if downloads is None:
            return await self.fetcher.fetch(url, item=src.name)
        task = downloads.get(url)
        if task is None:
            task = downloads[url] = asyncio.ensure_future(self.fetcher.fetch(url, item=src.name))
        return await asyncio.shield(task)


def _no_room(held: MediaLease | None, name: str, needed_bytes: int | None, cause: Exception) -> APIError:
    """A put refused because the node cache is held by leases: 413 or 503 (``MediaLease.no_room``)."""
    return cache_full(name, cause) if held is None else held.no_room(name, needed_bytes, cause)


@dataclass(frozen=True)
class RequestSeconds:
    """One request's audio and video seconds, as their headers declare them (before any work)
    and as encoded (before the engine sees them), each against the request's cap."""

    declared: MediaSeconds
    encoded: MediaSeconds

    @classmethod
    def of(cls, limits: MediaLimits) -> RequestSeconds:
        return cls(
            MediaSeconds(limits.max_request_media_seconds), MediaSeconds(limits.max_request_media_seconds)
        )


def silent_track() -> EmbeddingRef:
    """The sound track of a video without one: zero rows. The prompt lays the video out without
    audio blocks and the engine never receives it (``epd.prompt_format.prompt_media``)."""
    return EmbeddingRef(key="", dtype="float32", shape=(0, 0), grid_thw=((1, 1, 0),), modality="audio")


def _url(src: MediaSource) -> str:
    assert src.url is not None
    return src.url
