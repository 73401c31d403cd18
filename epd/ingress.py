"""The ingress's long-lived state: one aiohttp session, the fetcher, the node cache, the router,
the media pipeline, the tokenizer and the engine client, plus the health loop that keeps the
router's view of the encoders and the metrics' view of the node current."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp

from encoder.caches.embed_cache import EmbedCache
from encoder.caches.embedding_tier import EmbeddingTier
from epd.config import IngressConfig
from epd.encoder_client import EncoderClient
from epd.encoder_router import EncoderRouter, WorkerSpec
from epd.engine_pool import EnginePool
from epd.llm_servers.base import LLMServer, ServerMismatch
from epd.llm_servers.epd_engine import EpdEngineServer
from epd.llm_servers.vllm_ec import ECFolder
from epd.llm_servers.vllm_routing import parse_kv_events
from epd.llm_servers.vllm_server import ModelInfo, VLLMServer
from epd.media_pipeline import AudioKeying, MediaPipeline
from epd.metrics import IngressMetrics
from epd.prompt_format import PromptFormat
from epd_common.errors import APIError
from epd_common.loop_lag import LoopLag
from epd_common.runtime import CLIENT_KEEP_ALIVE_S
from epd_common.store.guarded import GuardedStore
from epd_common.store_config import build_store
from llm_core.prompts.tokenizer import Tokenizer, load_tokenizer
from media_io.fetch import Fetcher

log = logging.getLogger("epd.ingress")


STREAM_LINE_BYTES = 1 << 20  # the longest SSE line read from an LLM server
CHECK_TIMEOUT_S = 30.0  # an LLM server's start-up check (vLLM: models, then a one-row probe)


class Ingress:
    def __init__(self, config: IngressConfig) -> None:
        if not config.encoder_urls:
            raise ValueError("the ingress needs at least one encoder url")
        self.config = config
        self.metrics = IngressMetrics()
        self.fingerprint = ""
        self.audio: AudioKeying | None = None  # how the encoders key audio (None: they take none)
        self._session: aiohttp.ClientSession | None = None
        self._fetcher: Fetcher | None = None
        self._pipeline: MediaPipeline | None = None
        self._engines: EnginePool | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._check_task: asyncio.Task[None] | None = None  # servers' checks after a health round
        self.loop_lag = LoopLag()  # how long this event loop was stalled (/health, /metrics)
        self.metrics.loop_lag_worst.set_function(lambda: self.loop_lag.worst_s)
        # What each role reported it runs ({"paths": {step: impl}, "fallbacks": [...]}), from the
        # last health poll: the start banner and /health show it.
        self.encoder_paths: dict[str, dict[str, Any]] = {}
        self.engine_paths: dict[str, Any] = {}
        self.cache = EmbedCache(namespace=config.cache_namespace, capacity_bytes=config.cache_capacity_bytes)
        weights = config.encoder_weights or (1,) * len(config.encoder_urls)
        # One failed or passed poll flips a worker (calls that cannot connect take it out at once).
        self.router = EncoderRouter(
            [WorkerSpec(u, w) for u, w in zip(config.encoder_urls, weights, strict=True)],
            fall_after=1,
            rise_after=1,
        )
        self.tokenizer: Tokenizer = load_tokenizer(config.llm_model_dir)
        self.prompt_format = PromptFormat.load(config.llm_model_dir, self.tokenizer)
        self.chats_inflight = 0
        self.store: GuardedStore | None = None
        self.llm_server: LLMServer = EpdEngineServer(self.prompt_format)
        # LLM servers that passed the server kind's check since they were last down (vLLM: the model,
        # its width, embeddings input); only these are routed to
        self._checked: set[str] = set()
        self._check_errors: dict[str, str] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEP_ALIVE_S),
            # a streamed line may be up to twice this (a chunk with logprobs); longer is a 502
            read_bufsize=STREAM_LINE_BYTES // 2,
        )
        self.encoder_client = EncoderClient(self._session, timeout_s=self.config.request_timeout_s)
        self._fetcher = Fetcher(self.config.fetch)
        await self._fetcher.__aenter__()
        if self.config.llm_urls:
            self.llm_server = self._make_llm_server()
            router = self.config.llm_router
            if router.policy not in self.llm_server.routing_policies:
                # a server kind whose caches the router cannot see: least-load instead
                log.info("LLM routing: %s over %s servers", "least_load", self.llm_server.name)
                router = dataclasses.replace(router, policy="least_load")
            self._engines = EnginePool(
                self._session,
                self.config.llm_urls,
                self.tokenizer,
                router,
                self.metrics.registry,
                timeout_s=self.config.request_timeout_s,
                roles=self.config.llm_roles,
                make_client=self.llm_server.client,
            )
            self._engines.start()
            if self.llm_server.checks_servers:
                await self._check_servers(self.config.llm_urls, at_start=True)
        self.fingerprint = await self._encoder_fingerprint()
        self.store = build_store(self.config.store)
        tier = None
        if self.store is not None:
            cfg = self.config.store
            tier = EmbeddingTier(self.store, self.cache, ttl_s=cfg.ttl_s, claim_ttl_s=cfg.claim_ttl_s)
        self._pipeline = MediaPipeline(
            fetcher=self._fetcher,
            router=self.router,
            cache=self.cache,
            client=self.encoder_client,
            preprocess=self.config.preprocess,
            fingerprint=self.fingerprint,
            metrics=self.metrics,
            max_inflight=self.config.max_inflight_items,
            max_queue_wait_s=self.config.max_queue_wait_s,
            tier=tier,
            audio=self.audio,
            limits=self.config.limits,
        )
        await self.poll_health()
        self._health_task = asyncio.create_task(self._health_loop(), name="epd-ingress-health")
        self.loop_lag.start()

    async def stop(self) -> None:
        await self.loop_lag.stop()
        if self._check_task is not None:
            self._check_task.cancel()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._engines is not None:
            self._engines.close()
            await self.llm_server.close()
        if self.store is not None:
            self.store.close()
        if self._fetcher is not None:
            await self._fetcher.__aexit__(None, None, None)
        if self._session is not None:
            await self._session.close()
        self.cache.close()

    def _make_llm_server(self) -> LLMServer:
        """The configured kind of LLM server; the prompt format keeps only the modalities it hands on."""
        if self.config.llm_server == "epd":
            return EpdEngineServer(self.prompt_format)
        if self.config.llm_model_dir is None:
            raise ValueError("--llm-server vllm needs the checkpoint directory (--model DIR)")
        model = ModelInfo.of(self.config.llm_model_dir)
        # the family's profile says which media vLLM takes as embeddings, and why not the others
        self.prompt_format = self.prompt_format.only(
            model.profile.embeds, VLLMServer.name, model.profile.refused_because
        )
        cfg = self.config
        return VLLMServer(
            self.prompt_format,
            model,
            self.cache,
            ec=ECFolder.of(cfg),  # --vllm-ec-path: the embeddings as files vLLM reads
            kv_events=parse_kv_events(cfg.vllm_kv_events, cfg.llm_urls),
            block_size=cfg.vllm_block_size,
            render_routes=cfg.llm_router.policy == "affinity",
            route=cfg.vllm_route,
        )

    async def _check_servers(self, urls: Sequence[str], at_start: bool = False) -> None:
        """Ask each server what it serves, and route to it only once it passed (``_checked``).
        At start a mismatch stops the start-up (``ServerMismatch``); later (a server that was
        down at start, or came back: it may be another model now) it keeps the server out of
        routing, with an error logged once per message."""
        engines = self.engines
        for url in urls:
            try:
                try:  # its own bound: a hung server must not hold the others' checks
                    await asyncio.wait_for(
                        self.llm_server.check_server(engines.clients[url]), CHECK_TIMEOUT_S
                    )
                except TimeoutError as exc:
                    raise ConnectionError(
                        f"it did not answer the check within {CHECK_TIMEOUT_S:g} s"
                    ) from exc
            except (ConnectionError, APIError, ServerMismatch) as exc:
                if at_start and isinstance(exc, ServerMismatch):
                    raise
                if self._check_errors.get(url) != str(exc):
                    self._check_errors[url] = str(exc)
                    log.error("LLM server %s kept out of routing: %s", url, exc)
                engines.mark(url, False)
                continue
            self._checked.add(url)
            self._check_errors.pop(url, None)
            engines.mark(url, True)

    def llm_server_up(self, url: str) -> None:
        """The supervisor restarted ``url``'s server: into routing now, or (a server kind that checks
        its servers) once the next health round has checked it again."""
        if self.llm_server.checks_servers:
            self._checked.discard(url)
        else:
            self.engines.mark(url, True)

    def _recheck_servers(self) -> None:
        """After a health round: servers that answer but have not passed their check since they
        were last down are taken out of routing and asked again, on a task of their own (the
        health rounds go on meanwhile; one check at a time)."""
        engines = self.engines
        for url, up in engines.up.items():
            if not up:
                self._checked.discard(url)
        pending = [u for u, up in engines.up.items() if up and u not in self._checked]
        for url in pending:
            engines.mark(url, False)  # nothing is routed there while it is asked
        if pending and (self._check_task is None or self._check_task.done()):
            self._check_task = asyncio.create_task(self._check_servers(pending), name="epd-llm-checks")

    @property
    def pipeline(self) -> MediaPipeline:
        assert self._pipeline is not None, "Ingress.start() has not run"
        return self._pipeline

    @property
    def engines(self) -> EnginePool:
        if self._engines is None:
            raise APIError(404, "this ingress has no LLM engine configured", type="not_found")
        return self._engines

    @property
    def engine_up(self) -> bool:
        """At least one engine is in the routing set."""
        return self._engines is not None and self._engines.any_up

    async def _encoder_fingerprint(self) -> str:
        """All encoders must serve the same checkpoint: its fingerprint is part of every MediaKey."""
        deadline = asyncio.get_running_loop().time() + 60.0
        while True:
            healths = await asyncio.gather(*(self.encoder_client.health(u) for u in self.config.encoder_urls))
            prints = {h.get("fingerprint") for h in healths if h}
            if len(prints) > 1:
                raise RuntimeError(f"encoder workers serve different checkpoints: {sorted(map(str, prints))}")
            if prints:
                audio = {AudioKeying.from_health(h.get("audio")) for h in healths if h}
                if len(audio) > 1:
                    raise RuntimeError("encoder workers disagree on their audio encoders")
                self.audio = audio.pop()
                return str(prints.pop())
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"no encoder answered /health: {list(self.config.encoder_urls)}")
            await asyncio.sleep(0.2)

    # -- health ----------------------------------------------------------------------------------
    async def poll_health(self) -> None:
        """One health round: every encoder (its state goes through the router) and the engine."""
        if self.store is not None:
            self.metrics.store_up.set(1.0 if self.store.up else 0.0)
            self.metrics.store_errors.set(float(self.store.counters.errors))
        await self.router.check_all(self._encoder_ok)
        self.metrics.encoders_up.set(len(self.router.live_workers))
        if self._engines is not None:
            await self._engines.poll()
            if self.llm_server.checks_servers:
                self._recheck_servers()
            healths = [self._engines.healths[u] for u, up in self._engines.up.items() if up]
            if healths:
                self.engine_paths = _paths_of(healths[0])
            for pool in ("full", "swa"):  # the node's engines together
                usage = [float(h.get(f"kv_{pool}_usage", 0.0)) for h in healths]
                self.metrics.kv_usage.labels(pool=pool).set(sum(usage) / len(usage) if usage else 0.0)
            self.metrics.llm_waiting.set(float(sum(int(h.get("num_waiting", 0)) for h in healths)))

    async def _encoder_ok(self, url: str) -> bool:
        """Whether ``url`` answers /health with this deployment's fingerprint; records its load."""
        health = await self.encoder_client.health(url)
        if health:
            self.encoder_paths[url] = _paths_of(health)
            self.metrics.encoder_queue_depth.labels(worker=url).set(float(health.get("queue_depth", 0)))
            self.metrics.encoder_batch_size.labels(worker=url).set(float(health.get("last_batch_items", 0)))
        return health is not None and health.get("fingerprint") == self.fingerprint

    def active_paths(self) -> dict[str, Any]:
        """What the roles run, as last reported: ``{"paths": {"encoders": {url: ...}, "llm": ...},
        "fallbacks": ["<role>: <step>: why", ...]}``."""
        fallbacks = [f"encoder {url}: {f}" for url, p in self.encoder_paths.items() for f in p["fallbacks"]]
        fallbacks += [f"llm: {f}" for f in self.engine_paths.get("fallbacks", [])]
        return {
            "paths": {
                "encoders": {url: p["paths"] for url, p in self.encoder_paths.items()},
                "llm": self.engine_paths.get("paths", {}),
            },
            "fallbacks": fallbacks,
        }

    def routing_stats(self) -> dict[str, Any] | None:
        """The LLM router's view (per engine: live, index mode, load, routed, predicted vs actual
        cached tokens; the load spread); None without engines."""
        if self._engines is None:
            return None
        out = _plain(self._engines.router.stats())  # the prefill (or only) router: affinity
        if self._engines.decode_router is not None:
            out["decode"] = _plain(self._engines.decode_router.stats())  # split roles: by load
        return out  # type: ignore[no-any-return]

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.poll_health()
            except Exception:  # the loop must outlive any one bad poll
                log.exception("health poll failed")


def _paths_of(health: dict[str, Any]) -> dict[str, Any]:
    """The ``paths`` / ``fallbacks`` part of a role's /health body (empty for an older role)."""
    return {"paths": dict(health.get("paths") or {}), "fallbacks": list(health.get("fallbacks") or [])}


def _plain(value: Any) -> Any:
    """NamedTuples (nested) as JSON objects."""
    if hasattr(value, "_asdict"):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
