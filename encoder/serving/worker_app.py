"""The encoder worker's HTTP app (starlette): bytes in, EmbeddingRef out.

    POST /encode?modality=image|video|audio&item=NAME   body: raw compressed media
        sniff ─▶ MediaKey ─▶ node cache hit? ──yes──▶ ref (cache_hit: true)
                               │ no (one in-flight encode per key in this process)
                               ▼
        decode + preprocess (thread pool) ─▶ EncodeBatcher (forward thread) ─▶ cache.put ─▶ ref
        audio: decode_audio + log_mel (thread pool) ─▶ AudioBatcher (its forward threads) ─▶ ...
    GET /embeddings/{key}   safetensors body: tensor "embedding", metadata grid_thw/modality
    GET /health             {"status": "ok", "fingerprint", "audio": null or {"fingerprint",
                            "settings", "out_hidden_size"}, "queue_depth", ..., "paths": what
                            decodes and preprocesses, "fallbacks": stand-ins in use and why}

Audio (a checkpoint with an audio encoder, ``encoder.models.audio_checkpoint``; the steps are
``audio_path.AudioPath``'s): the clip is decoded to mono at the model's rate and turned into its
log-mel in the decode pool (torch, on the model's device: ``paths.log_mel`` says "torch"), then
batched with other requests' clips into one call of the audio encoder. Its ref has modality "audio", shape [pads, hidden] with one row per
``<|audio_pad|>`` (``AudioTokenRule.pad_count`` of the mel frames) and grid_thw ((1, 1, pads),).
Its MediaKey folds the audio settings (``AudioSettings``) and the audio encoder's own fingerprint
(``audio.fingerprint`` in /health), so image and video keys are what they were. A checkpoint
without one answers audio with 415 naming what it lacks. Admission counts a clip's mel frames
against the audio stage's own queue and measured rate (``stage_work``), apart from the patches. A video's
sound track is ``modality=audio&track=1`` with the video's bytes: the whole track is encoded and
the rows laid out beside the video's sampled frames are kept (``media_io.audio_track``); its key
folds the video sampling that cut it (``AudioSettings.for_track``).
    GET /metrics            prometheus text

The event loop only awaits: hashing, decoding, preprocessing and cache I/O run in the decode
pool, the forward in the batcher's thread, so the next items are decoded while a forward runs.
Admission is by expected wait (``epd_common.admission``), in patches: an item is taken while the
patches admitted ahead of it, plus its own (``media_io.work_estimate``: from the image header, a
video's from the recent mean), would be done within the deadline at the patches per second the
worker has been serving. The deadline is ``max_queue_wait_s``, or the client's shorter timeout
(``X-Request-Timeout``, which the ingress sets to what is left of its own). Beyond it, or past the
memory guards (``max_queued_bytes``, ``max_inflight`` items, ``max_queue_patches`` in the
batcher), the answer is 503 with Retry-After = the expected wait. A bad item fails alone with the
status of its MediaError and a JSON body naming it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, NoReturn, TypeVar

import msgspec
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from safetensors.torch import save as save_safetensors
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from encoder.caches.embed_cache import CacheFull, EmbedCache, EntryTooLarge, InvalidKey
from encoder.caches.embedding_tier import EmbeddingTier
from encoder.caches.media_key import KeySettings, media_key
from encoder.models.audio_checkpoint import LoadedAudioEncoder, NoAudio, load_audio_encoder
from encoder.models.checkpoint import LoadedEncoder, load_encoder
from encoder.serving.audio_path import LOG_MEL_PATH, AudioPath
from encoder.serving.batcher import EncodeBatcher, QueueFull
from encoder.serving.stage_work import StageWork
from encoder.serving.worker import WorkerConfig
from epd_common.active_paths import report
from epd_common.admission import (
    admission_bound_s,
    bound_text,
    late_bound_s,
    request_deadline_s,
    retry_after_header,
)
from epd_common.errors import CACHE_FULL, ENTRY_BYTES_HEADER, error_body
from epd_common.messages.embedding_ref import EmbeddingRef
from epd_common.messages.encode_reply import EncodeReply
from epd_common.runtime import freeze_startup_objects
from epd_common.store_config import build_store
from media_io.active_paths import media_paths
from media_io.audio_track import decode_until_s, track_rows, track_window
from media_io.errors import BadMedia, MediaError, MediaTooLarge, UnsupportedMedia
from media_io.preprocess import Patches, PreprocessBackend, get_backend
from media_io.sniff import MediaKind, sniff
from media_io.video import decode_video, warm_decode_pool
from media_io.work_estimate import PatchEstimator

log = logging.getLogger("epd.encoder.worker")
STAGES = ("decode", "preprocess", "queue", "forward")


class VideoTiming(NamedTuple):
    """When a video's temporal patches happen, as the prompt and positions need it (images: none)."""

    # temporal_patch_size over the sampled frame rate ((sampled / total frames) x the stream's fps),
    # as transformers' Qwen2.5-VL processor computes ``second_per_grid_ts``: M-RoPE's time spacing
    seconds_per_grid_t: float | None = None
    # the time of each temporal patch's first frame (media_io's sampling rule): prompt timestamps
    grid_t_timestamps: tuple[float, ...] = ()


_T = TypeVar("_T")


class _Late(NamedTuple):
    late_s: float  # how long after its start-by time the item's turn came


def _unless_late(start_by: float, fn: Callable[..., _T], *args: object) -> _T | _Late:
    """In the decode pool: ``fn(*args)``, or ``_Late`` when the turn came after ``start_by``."""
    now = time.monotonic()
    return _Late(now - start_by) if now > start_by else fn(*args)


class Overloaded(Exception):
    """The worker cannot take the item in time (or without exceeding its memory guard); the client
    should retry after ``retry_after_s`` (503 with that Retry-After). ``reason``: "wait" (the queue
    ahead would not drain within the deadline), "memory" (the byte or count guard) or "late" (an
    admitted item whose turn came too late to be done within the deadline)."""

    def __init__(self, message: str, retry_after_s: float, reason: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason


class EncodeOutcome(NamedTuple):
    ref: EmbeddingRef
    cache_hit: bool
    timings_ms: dict[str, float]


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("epd_encoder_requests", "POST /encode by outcome", ["outcome"], registry=r)
        self.stage = Histogram(
            "epd_encoder_stage_seconds",
            "Per-item time in each stage",
            ["stage"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=r,
        )
        self.inflight = Gauge("epd_encoder_inflight_items", "Items past the cache check", registry=r)
        self.inflight_peak = Gauge(
            "epd_encoder_inflight_peak_items", "The most items past the cache check at once", registry=r
        )
        self.expected_wait = Gauge(
            "epd_encoder_expected_wait_seconds", "What a new item would wait (admission)", registry=r
        )
        self.refusals = Counter(
            "epd_encoder_refusals", "Items refused at admission, by reason", ["reason"], registry=r
        )
        self.queue_items = Gauge("epd_encoder_queue_items", "Items waiting for a forward", registry=r)
        self.batches = Gauge("epd_encoder_batches", "Forwards run since start", registry=r)
        self.last_batch = Gauge("epd_encoder_last_batch_items", "Items in the last forward", registry=r)
        self.forward_s = Gauge(
            "epd_encoder_forward_seconds", "Time spent in forwards since start", registry=r
        )


def serving_fingerprint(checkpoint_fingerprint: str, backend: str) -> str:
    """What every MediaKey of this worker folds in: the checkpoint and the preprocessing backend.

    The cpu and dali backends agree with the reference within tolerance, not bit for bit, so
    workers with different backends must not share cache entries. The ingress learns this value
    from /health, so its keys match the workers'.
    """
    return hashlib.sha256(f"{checkpoint_fingerprint}|preprocess={backend}".encode()).hexdigest()


class EncoderWorker:
    """The state behind the routes: model, batcher, node cache, preprocessing backend, pools."""

    def __init__(
        self,
        config: WorkerConfig,
        loaded: LoadedEncoder,
        cache: EmbedCache,
        tier: EmbeddingTier | None = None,
        audio: LoadedAudioEncoder | NoAudio = NoAudio("no audio encoder was loaded"),
    ) -> None:
        """``tier``: the store shared by the nodes (asked before encoding, written after);
        ``audio``: the checkpoint's audio encoder, or why there is none."""
        self.config = config
        self.loaded = loaded
        self.audio = audio
        self.cache = cache
        self.tier = tier
        self.backend: PreprocessBackend = get_backend(config.preprocess_backend, config.preprocess)  # type: ignore[arg-type]
        self.paths = report(media_paths(config.preprocess_backend))  # for /health
        self.batcher = EncodeBatcher(
            loaded.model,
            patch_budget=config.batch_budget(),
            max_wait_ms=config.max_wait_ms,
            max_queue_patches=config.max_queue_patches,
            forward_streams=config.forward_streams or 1,
        )
        self.audio_path: AudioPath | None = None
        if isinstance(audio, LoadedAudioEncoder):
            self.audio_path = AudioPath(audio, config.max_wait_ms, config.forward_streams or 1)
            self.paths["paths"]["log_mel"] = LOG_MEL_PATH
        self.pool = ThreadPoolExecutor(
            max_workers=config.decode_threads, thread_name_prefix="epd-encoder-decode"
        )
        # Hashing and cache I/O get their own threads so that cache hits never queue behind decodes.
        self.io_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="epd-encoder-io")
        self.metrics = _Metrics()
        self.writer = f"encoder:{os.getpid()}"
        self._inflight: dict[str, asyncio.Task[EncodeOutcome]] = {}
        self._admitted = 0
        self._admitted_bytes = 0
        self.peak_admitted = 0  # the most items in flight at once since start
        # Admission by expected wait (``epd_common.admission``): patches per busy second, measured
        # from admission to done, so a burst the worker drains within the deadline is taken whole.
        # Admission's work per stage: the vision batcher's patches, the audio batcher's mel frames
        self.pixels = StageWork("patches", config.admission_seed_patches_per_s, config.max_queue_wait_s)
        self.sound = StageWork("mel frames", config.admission_seed_mel_frames_per_s, config.max_queue_wait_s)
        self.estimator = PatchEstimator(config.preprocess)

    @property
    def fingerprint(self) -> str:
        return serving_fingerprint(self.loaded.fingerprint, self.backend.name)

    def key_settings(self, modality: str, track: bool = False) -> tuple[KeySettings, str]:
        """What a ``modality`` item's MediaKey folds in: its settings and the fingerprint
        (``track``: a video's sound track, cut by this worker's video sampling)."""
        if modality == "audio":
            assert self.audio_path is not None
            settings = self.audio_path.settings
            if track:
                settings = settings.for_track(self.config.preprocess)
            return settings, self.audio_path.fingerprint
        return self.config.preprocess, self.fingerprint

    async def start(self) -> None:
        await self.batcher.start()
        if self.audio_path is not None:
            await self.audio_path.start()

    async def stop(self) -> None:
        for task in list(self._inflight.values()):
            task.cancel()
        await asyncio.gather(*self._inflight.values(), return_exceptions=True)
        await self.batcher.stop()
        if self.audio_path is not None:
            await self.audio_path.stop()
        self.pool.shutdown(wait=True)
        self.io_pool.shutdown(wait=True)
        self.cache.close()

    # -- encode ------------------------------------------------------------------------------------
    async def encode(
        self,
        data: bytes,
        modality: str | None,
        item: str | None,
        deadline_s: float | None = None,
        track: bool = False,
    ) -> EncodeOutcome:
        """Encode one item's bytes (or find it in the node cache). ``deadline_s``: the client's
        timeout (admission uses the shorter of it and ``max_queue_wait_s``). ``track``: the bytes
        are a video whose sound track is wanted, cut to the video's sampled frames
        (``media_io.audio_track``)."""
        if len(data) > self.config.limits.max_bytes:
            raise MediaTooLarge(f"body of {len(data)} bytes exceeds {self.config.limits.max_bytes}", item)
        kind = sniff(data)
        if track and (modality != "audio" or kind.modality != "video"):
            raise BadMedia(
                f"a sound track is asked as modality audio of a video; got modality {modality} of "
                f"{kind.modality} ({kind.format})",
                item,
            )
        if modality == "audio" and kind.modality == "video":
            # a video's sound track: its container's audio stream, encoded as audio
            kind = MediaKind("audio", kind.format)
        if modality is not None and modality != kind.modality:
            raise BadMedia(f"sent as {modality} but its bytes are {kind.modality} ({kind.format})", item)
        if kind.modality == "audio" and isinstance(self.audio, NoAudio):
            raise UnsupportedMedia(
                f"audio ({kind.format}) is not supported: this encoder has no audio tower"
                f" ({self.audio.reason})",
                item,
            )
        loop = asyncio.get_running_loop()
        settings, fingerprint = self.key_settings(kind.modality, track)
        key = await loop.run_in_executor(self.io_pool, media_key, data, kind.modality, settings, fingerprint)
        hit = await loop.run_in_executor(self.io_pool, self.cache.get, key)
        if hit is not None:
            self.metrics.requests.labels(outcome="hit").inc()
            return EncodeOutcome(self._public(hit.ref), True, dict.fromkeys(STAGES, 0.0))
        units: float | None = None
        if kind.modality == "audio" and key not in self._inflight:
            # its header is opened (a container parse): off the loop, before the in-flight check
            units = await loop.run_in_executor(self.io_pool, self.estimator.estimate, data, kind.modality)
        task = self._inflight.get(key)
        shared = task is not None
        if task is None:
            if units is None:
                units = self.estimator.estimate(data, kind.modality)
            stage = self.stage(kind.modality)
            self._admit(len(data), units, deadline_s, stage)
            start_by = self._start_by(units, deadline_s, stage)
            # A task of its own: if this request goes away, the encode still lands in the cache, and
            # concurrent requests for the same media (other ingresses) share it.
            task = asyncio.create_task(self._encode_miss(data, kind.modality, key, item, start_by, track))
            self._inflight[key] = task
            self._admitted += 1
            self._admitted_bytes += len(data)
            stage.admit(key, units)
            self.metrics.inflight.set(self._admitted)
            self.peak_admitted = max(self.peak_admitted, self._admitted)
            self.metrics.inflight_peak.set(self.peak_admitted)
            size = len(data)
            task.add_done_callback(lambda t: self._finished(key, size, t))
        outcome = await asyncio.shield(task)
        if shared:  # computed for another request: nothing was spent on this one
            self.metrics.requests.labels(outcome="shared").inc()
            return outcome._replace(cache_hit=True, timings_ms=dict.fromkeys(STAGES, 0.0))
        if not outcome.cache_hit:  # (a hit from the shared store was counted as "store")
            self.metrics.requests.labels(outcome="miss").inc()
        return outcome

    def stage(self, modality: str) -> StageWork:
        """The stage that encodes ``modality`` (its queue and rate)."""
        return self.sound if modality == "audio" else self.pixels

    def _stage_holding(self, key: str) -> StageWork:
        """The stage an admitted ``key`` was admitted to."""
        return self.sound if key in self.sound else self.pixels

    def expected_wait_s(self) -> float:
        """When a new image would be done: the vision stage's work ahead at its measured rate
        (the audio stage's is in /health ``audio``)."""
        return self.pixels.expected_wait_s()

    def _admit(self, nbytes: int, units: float, deadline_s: float | None, stage: StageWork) -> None:
        """Raise ``Overloaded`` unless an item of ``nbytes`` and ``units`` patches can be taken: done
        within the deadline, and the bytes and items held within their guards. An idle worker
        takes any item; one whose own encode alone would outlast the deadline (a long video) is
        judged by the wait before its turn, or it could never be taken while others are."""
        deadline = self._deadline(deadline_s)
        bound = admission_bound_s(deadline)  # the answer's way out is not in the estimate
        wait = stage.expected_wait_s(units)
        if stage.rate.expected_wait_s(units) > bound:
            wait = stage.expected_wait_s()
        self.metrics.expected_wait.set(wait)
        cfg = self.config
        if wait > bound and self._admitted:
            self._refuse(
                "wait",
                f"expected wait {wait:.1f} s ({stage.queued:.0f} {stage.unit} ahead and {units:.0f} of"
                f" its own at {stage.rate.per_s():.0f} {stage.unit}/s, scaled for how late recent items"
                f" were) exceeds {bound_text(deadline)}",
                stage.typical_wait_s(units),
            )
        if self._admitted_bytes + nbytes > cfg.max_queued_bytes or self._admitted >= cfg.max_inflight:
            self._refuse(
                "memory",
                f"{self._admitted} items of {self._admitted_bytes} bytes in flight"
                f" (guards: {cfg.max_inflight} items, {cfg.max_queued_bytes} bytes)",
                wait,
            )

    def _deadline(self, deadline_s: float | None) -> float:
        """The deadline an item is held to: the worker's, or the client's shorter one."""
        return (
            self.config.max_queue_wait_s
            if deadline_s is None
            else min(deadline_s, self.config.max_queue_wait_s)
        )

    def _start_by(self, units: float, deadline_s: float | None, stage: StageWork) -> float:
        """When an item admitted now must start to be done when due (``admission.late_bound_s``):
        its own work before that, at the stage's rate; an item whose own work alone outlasts the
        admission bound (a long video) was admitted by its turn, and is held to its turn."""
        deadline = self._deadline(deadline_s)
        own = stage.rate.expected_wait_s(units)
        own = own if own <= admission_bound_s(deadline) else 0.0
        return time.monotonic() + late_bound_s(deadline) - own

    async def _in_time(self, key: str, start_by: float, fn: Callable[..., _T], *args: object) -> _T:
        """``fn(*args)`` in the decode pool, unless the item's turn there comes after
        ``start_by``: then it is shed (``Overloaded``, reason "late") rather than computed for a
        client that will have given up."""
        stage = self._stage_holding(key)
        out = await asyncio.get_running_loop().run_in_executor(self.pool, _unless_late, start_by, fn, *args)
        if isinstance(out, _Late):
            self.metrics.refusals.labels(reason="late").inc()
            raise Overloaded(
                f"its turn came {out.late_s:.1f} s too late to be done within the deadline"
                f" ({stage.queued:.0f} {stage.unit} queued at {stage.rate.per_s():.0f} {stage.unit}/s):"
                " shed rather than answered late",
                stage.typical_wait_s(),
                "late",
            )
        return out

    def _refuse(self, reason: str, message: str, wait_s: float) -> NoReturn:
        """Count a refusal by ``reason`` and raise it (the client retries after ``wait_s``)."""
        self.metrics.refusals.labels(reason=reason).inc()
        raise Overloaded(message, wait_s, reason)

    def _finished(self, key: str, nbytes: int, task: asyncio.Task[EncodeOutcome]) -> None:
        del self._inflight[key]  # first: nothing below may leave a done task in the map
        self._admitted -= 1
        self._admitted_bytes -= nbytes
        self._stage_holding(key).finish(key, ok=not task.cancelled() and task.exception() is None)
        self.metrics.inflight.set(self._admitted)
        self.metrics.expected_wait.set(self.expected_wait_s())
        if not task.cancelled():
            task.exception()  # retrieved here: the awaiting requests re-raise it

    async def _encode_miss(
        self, data: bytes, modality: str, key: str, item: str | None, start_by: float, track: bool = False
    ) -> EncodeOutcome:
        loop = asyncio.get_running_loop()
        claimed = False
        if self.tier is not None:
            # Another node may have it, or be computing it right now (it holds the claim).
            ref = await loop.run_in_executor(self.io_pool, self.tier.lookup, key)
            if ref is None:
                claimed = await loop.run_in_executor(self.io_pool, self.tier.claim, key)
                if not claimed:
                    ref = await self.tier.wait_for(key, self.io_pool, self.tier.claim_ttl_s)
            if ref is not None:
                self.metrics.requests.labels(outcome="store").inc()
                self._correct(key, 0.0)  # nothing was encoded: no work done, no work ahead
                return EncodeOutcome(self._public(ref), True, dict.fromkeys(STAGES, 0.0))
        try:
            outcome = await self._compute(data, modality, key, item, start_by, track)
        except BaseException:
            if claimed and self.tier is not None:
                self._background(self.tier.unclaim, key)
            raise
        if self.tier is not None:
            self._background(self._publish, key, claimed)
        return outcome

    def _correct(self, key: str, units: float) -> None:
        """An admitted item's real units replace its estimate (``StageWork.correct``)."""
        self._stage_holding(key).correct(key, units)

    def _publish(self, key: str, claimed: bool) -> None:
        """After the reply: the new embedding goes to the shared store, then the claim is let go."""
        assert self.tier is not None
        self.tier.publish(key)
        if claimed:
            self.tier.unclaim(key)

    def _background(self, fn: Callable[..., object], *args: object) -> None:
        """Store calls after the reply (the store is guarded: they never raise)."""
        asyncio.get_running_loop().run_in_executor(self.io_pool, fn, *args)

    async def _compute(
        self, data: bytes, modality: str, key: str, item: str | None, start_by: float, track: bool = False
    ) -> EncodeOutcome:
        """``start_by`` (monotonic): shed when its turn in the decode pool comes later."""
        if modality == "audio":
            return await self._compute_audio(data, key, item, start_by, track)
        loop = asyncio.get_running_loop()
        timings: dict[str, float] = {}
        patches, timing = await self._in_time(
            key, start_by, self._decode_preprocess, data, modality, item, timings
        )
        self.estimator.observe(modality, patches.num_patches)
        self._correct(key, float(patches.num_patches))
        result = await self.batcher.encode_timed(patches)
        timings["queue"] = result.queue_ms
        timings["forward"] = result.forward_ms
        try:
            ref = await loop.run_in_executor(
                self.io_pool,
                self.cache.put,
                key,
                result.embedding,
                [patches.grid_thw],
                modality,
                self.writer,
                timing.seconds_per_grid_t,
                timing.grid_t_timestamps,
            )
        except EntryTooLarge as e:
            raise MediaTooLarge(f"its embedding does not fit the node cache: {e}", item) from e
        for stage, ms in timings.items():
            self.metrics.stage.labels(stage=stage).observe(ms / 1000.0)
        return EncodeOutcome(self._public(ref), False, timings)

    async def _compute_audio(
        self, data: bytes, key: str, item: str | None, start_by: float, track: bool
    ) -> EncodeOutcome:
        """An audio clip: its log-mel (decode pool), its rows (audio batcher), into the cache. A
        video's track (``track``) keeps the rows laid out beside its sampled frames."""
        path = self.audio_path
        assert path is not None
        loop = asyncio.get_running_loop()
        timings: dict[str, float] = {}
        window, until_s = None, None
        if track:  # the video's frame table only (no frame decoded): the sound beside its frames
            window = await loop.run_in_executor(
                self.pool, track_window, data, self.config.preprocess, self.config.limits, item
            )
            until_s = decode_until_s(window, path.segment_s)
        mel = await self._in_time(key, start_by, path.mel, data, self.config.limits, item, timings, until_s)
        frames = int(mel.shape[0])
        self.estimator.observe("audio", frames)
        self._correct(key, float(frames))
        result = await path.rows(mel)
        timings["queue"] = result.queue_ms
        timings["forward"] = result.forward_ms
        embedding = result.embedding  # [pads, hidden]
        if window is not None:
            kept = track_rows(int(embedding.shape[0]), window, path.settings.tokens_per_second)
            if kept.stop <= kept.start:
                raise BadMedia(
                    f"its sound track ends before the video's first sampled frame ({window.start_s:.2f} s)",
                    item,
                )
            embedding = embedding[kept]
        rows = int(embedding.shape[0])
        try:
            ref = await loop.run_in_executor(
                self.io_pool, self.cache.put, key, embedding, [(1, 1, rows)], "audio", self.writer
            )
        except EntryTooLarge as e:
            raise MediaTooLarge(f"its embedding does not fit the node cache: {e}", item) from e
        for stage, ms in timings.items():
            self.metrics.stage.labels(stage=stage).observe(ms / 1000.0)
        return EncodeOutcome(self._public(ref), False, timings)

    def _decode_preprocess(
        self, data: bytes, modality: str, item: str | None, timings: dict[str, float]
    ) -> tuple[Patches, VideoTiming]:
        """Runs in the decode pool. Fills timings["decode"] and timings["preprocess"] (ms). Returns
        the patches and, for a video, its timing (``VideoTiming``)."""
        cfg, limits = self.config, self.config.limits
        t0 = time.perf_counter()
        timing = VideoTiming()
        if modality == "video":
            frames = decode_video(data, cfg.preprocess, limits, item=item, workers=cfg.video_decode_workers)
            t1 = time.perf_counter()
            patches = self.backend.video(frames.frames, item)
            info = frames.info
            seconds_per_grid_t = None
            if info.num_frames and info.fps > 0:
                sampled_fps = len(frames.indices) / info.num_frames * info.fps
                seconds_per_grid_t = cfg.preprocess.temporal_patch_size / sampled_fps
            timing = VideoTiming(seconds_per_grid_t, frames.pair_timestamps)
        else:
            # Bytes straight to patches: the backend decodes at the scale the target needs (JPEG
            # DCT scaling on the CPU, nvJPEG with DALI), so decode and preprocess are one step,
            # reported as "decode".
            patches = self.backend.image_bytes(data, limits, item)
            t1 = time.perf_counter()
        t2 = time.perf_counter()
        timings["decode"] = (t1 - t0) * 1000.0
        timings["preprocess"] = (t2 - t1) * 1000.0
        return patches, timing

    def _public(self, ref: EmbeddingRef) -> EmbeddingRef:
        if self.config.public_url:
            return msgspec.structs.replace(
                ref, url=f"{self.config.public_url.rstrip('/')}/embeddings/{ref.key}"
            )
        return ref

    # -- reads -------------------------------------------------------------------------------------
    def embedding_body(self, key: str) -> bytes | None:
        """The safetensors body for GET /embeddings/{key}, or None when not cached."""
        hit = self.cache.get(key)
        if hit is None:
            return None
        metadata = {
            "key": key,
            "grid_thw": json.dumps([list(g) for g in hit.ref.grid_thw]),
            "modality": hit.ref.modality,
            "fingerprint": self.fingerprint,
        }
        return save_safetensors({"embedding": hit.tensor.contiguous()}, metadata=metadata)

    def health(self) -> dict[str, Any]:
        s = self.batcher.stats()
        cfg = self.loaded.config
        return {
            "status": "ok",
            "fingerprint": self.fingerprint,
            "audio": None
            if self.audio_path is None
            else {
                **self.audio_path.health(),
                "expected_wait_s": round(self.sound.expected_wait_s(), 4),
                "mel_frames_per_s": round(self.sound.rate.per_s(), 1),
            },
            "queue_depth": s.queue_items,
            "queue_patches": s.queue_patches,
            "inflight": self._admitted,
            "expected_wait_s": round(self.expected_wait_s(), 4),
            "patches_per_s": round(self.pixels.rate.per_s(), 1),
            "rate_measured": self.pixels.rate.measured,
            "last_batch_items": s.last_batch_items,
            "batches": s.batches,
            "device": str(self.loaded.model.device),
            "dtype": str(self.loaded.model.dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),
            "forward_streams": self.batcher.forward_streams,
            "out_hidden_size": cfg.out_hidden_size,
            "patch_budget": self.batcher.patch_budget,
            "cache_namespace": self.cache.namespace,
            "pid": os.getpid(),
            **self.paths,
        }

    def metrics_text(self) -> bytes:
        s = self.batcher.stats()
        m = self.metrics
        m.queue_items.set(s.queue_items)
        m.batches.set(s.batches)
        m.last_batch.set(s.last_batch_items)
        m.forward_s.set(s.forward_s)
        return generate_latest(m.registry)


def _warm_up(loaded: LoadedEncoder) -> None:
    """One small forward before serving: the first call pays for kernel selection and allocator
    growth (seconds on a busy CPU), which should not land on the first request."""
    patch_dim = loaded.config.patch_dim
    with torch.inference_mode():
        loaded.model(torch.zeros(256, patch_dim), torch.tensor([[1, 16, 16]]))


def _error(
    status: int, kind: str, message: str, param: str | None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, kind, message, param), status_code=status, headers=headers)


def build_app(
    config: WorkerConfig,
    loaded: LoadedEncoder | None = None,
    audio: LoadedAudioEncoder | NoAudio | None = None,
) -> Starlette:
    """The worker app. The models (unless ``loaded`` / ``audio`` are given) load and the cache opens
    at start-up; the audio encoder is the checkpoint's, when it has one."""
    state: dict[str, EncoderWorker] = {}

    def worker() -> EncoderWorker:
        return state["worker"]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        def open_all() -> EncoderWorker:
            enc = loaded or load_encoder(config.model_path, config.torch_dtype, config.resolve_device())
            aud = audio
            if aud is None:
                aud = load_audio_encoder(config.model_path, config.torch_dtype, config.resolve_device())
            _warm_up(enc)
            if isinstance(aud, LoadedAudioEncoder):
                AudioPath(aud, 0.0, 1).warm_up()
            warm_decode_pool(config.video_decode_workers)
            cache = EmbedCache(config.cache_namespace, config.cache_capacity_bytes, config.cache_root)
            store = build_store(config.store)
            tier = (
                EmbeddingTier(store, cache, ttl_s=config.store.ttl_s, claim_ttl_s=config.store.claim_ttl_s)
                if store
                else None
            )
            return EncoderWorker(config, enc, cache, tier, aud)

        w = await asyncio.get_running_loop().run_in_executor(None, open_all)
        await w.start()
        freeze_startup_objects()  # the model is loaded: its objects need no collecting
        state["worker"] = w
        log.info("encoder worker ready: fingerprint %s on %s", w.fingerprint[:16], w.loaded.model.device)
        try:
            yield
        finally:
            await w.stop()

    async def encode(request: Request) -> Response:
        item = request.query_params.get("item")
        modality = request.query_params.get("modality")
        if modality not in (None, "image", "video", "audio"):
            return _error(
                400,
                "invalid_request",
                f"modality must be 'image', 'video' or 'audio', got {modality!r}",
                "modality",
            )
        w = worker()
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.limits.max_bytes:
            msg = f"body of {declared} bytes exceeds {config.limits.max_bytes}"
            return _error(413, MediaTooLarge.kind, msg, item)
        data = await request.body()
        deadline = request_deadline_s(request.headers, config.max_queue_wait_s)
        try:
            outcome = await w.encode(data, modality, item, deadline, request.query_params.get("track") == "1")
        except MediaError as e:
            w.metrics.requests.labels(outcome="error").inc()
            return _error(e.status, e.kind, e.message, item)
        except Overloaded as e:
            w.metrics.requests.labels(outcome="overloaded").inc()
            return _error(
                503, "overloaded", str(e), item, headers={"Retry-After": retry_after_header(e.retry_after_s)}
            )
        except QueueFull as e:
            w.metrics.requests.labels(outcome="overloaded").inc()
            w.metrics.refusals.labels(reason="memory").inc()
            retry = retry_after_header(w.expected_wait_s())
            return _error(503, "overloaded", str(e), item, headers={"Retry-After": retry})
        except CacheFull as e:  # every entry it could evict is leased: room frees as requests end
            w.metrics.requests.labels(outcome="overloaded").inc()
            headers = {"Retry-After": "1", ENTRY_BYTES_HEADER: str(e.needed_bytes)}
            return _error(503, CACHE_FULL, str(e), item, headers=headers)
        except ValueError as e:  # patches the model cannot take (a preprocessing bug or odd input)
            w.metrics.requests.labels(outcome="error").inc()
            return _error(400, "bad_media", str(e), item)
        except Exception as e:
            log.exception("encode failed for %r", item)  # a client-named item: escaped
            w.metrics.requests.labels(outcome="error").inc()
            return _error(500, "internal_error", f"{type(e).__name__}: {e}", item)
        reply = EncodeReply(outcome.ref, outcome.cache_hit, outcome.timings_ms)
        return Response(reply.encode(), media_type="application/json")

    async def embedding(request: Request) -> Response:
        key = request.path_params["key"]
        try:
            # cache reads run on the I/O threads: they must not queue behind decodes
            body = await asyncio.get_running_loop().run_in_executor(
                worker().io_pool, worker().embedding_body, key
            )
        except InvalidKey as e:
            return _error(400, "invalid_request", str(e), "key")
        if body is None:
            return _error(404, "not_found", f"no embedding {key} in this node's cache", "key")
        return Response(body, media_type="application/octet-stream")

    async def health(request: Request) -> Response:
        return JSONResponse(worker().health())

    async def metrics(request: Request) -> Response:
        return Response(worker().metrics_text(), media_type="text/plain; version=0.0.4")

    routes = [
        Route("/encode", encode, methods=["POST"]),
        Route("/embeddings/{key}", embedding, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)
