"""The LLM engine process: an OpenAI-compatible completions server over ``LLMEngine``.

Routes:
    POST /v1/completions   prompt (text or token ids) -> completion, JSON or SSE (``stream``)
    GET  /v1/models        the served model, once per served id (``LLMServerConfig.served_model_names``;
                           responses report the first)
    GET  /health           {"status": "ok", running/waiting counts, KV usage, ..., "paths": what runs
                           the layers, "fallbacks": stand-ins in use and why, "backends": the
                           attention / moe / norm / layer backend names (``llm_core.backends``)}
    GET  /metrics          prometheus text

Every request error is answered before the first byte of a stream goes out, as JSON
``{"error": {"type", "message", "param", "code"}}`` with its status: 400 for a bad field, 503 +
Retry-After when admission refuses. Admission is by expected wait (``admission.py`` over
``epd_common.admission``): a request is refused when its first token would not come within its
deadline (``max_queue_wait_s``, or the client's shorter ``X-Request-Timeout`` /
``X-Stainless-Read-Timeout``), judged from the tokens of work waiting ahead and its own prompt at
the tokens per busy second the engine has been serving; Retry-After is that expected wait. An idle
engine takes any request that fits; ``max_waiting`` waiting requests (and a full scheduler queue)
are a memory guard that refuses with 503 too. A client that disconnects aborts its request, which
frees its KV pages at the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from epd_common.active_paths import report
from epd_common.admission import request_deadline_s
from epd_common.errors import APIError, bad_request, error_body, error_response, overloaded
from epd_common.messages.completion_request import KVTransfer
from epd_common.messages.completion_response import SSE_DONE, KVTransferReport, encode, sse_event, usage
from epd_common.messages.embedding_reader import ReaderOpener
from epd_common.runtime import freeze_startup_objects, serve_internal
from epd_common.store_config import build_store
from llm_core.serving.completion_request import (
    CompletionRequest,
    chunk_body,
    completion_body,
    parse_completion_request,
)
from llm_core.serving.embedding_source import EmbeddingSource
from llm_core.serving.engine import EngineOverloaded, EngineRequestError, LLMEngine, RequestStream
from llm_core.serving.kv_event_publisher import KVEventPublisher
from llm_core.serving.kv_handoff import KVHandoff
from llm_core.serving.server_config import LLMServerConfig

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


class _Metrics:
    """Prometheus view of ``LLMEngine.stats()``, refreshed on each scrape."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("epd_llm_requests", "Completion requests by status", ["status"], registry=r)
        self.running = Gauge("epd_llm_running_requests", "Requests being decoded", registry=r)
        self.waiting = Gauge("epd_llm_waiting_requests", "Requests waiting for admission", registry=r)
        self.kv_usage = Gauge(
            "epd_llm_kv_usage",
            "KV usage (0..1): pool=full / window (the fullest window group's pages), all (the storage)",
            ["pool"],
            registry=r,
        )
        self.tokens_per_s = Gauge("epd_llm_generation_tokens_per_second", "Recent output rate", registry=r)
        self.gen_tokens = Gauge("epd_llm_generation_tokens_total", "Generated tokens", registry=r)
        self.prompt_tokens = Gauge("epd_llm_prompt_tokens_total", "Prompt tokens received", registry=r)
        self.cached_tokens = Gauge(
            "epd_llm_cached_prompt_tokens_total", "Prompt tokens served by the prefix cache", registry=r
        )
        self.spec = Gauge(
            "epd_llm_speculative", "Speculative decoding: drafts verified / accepted, mean tokens per verify",
            ["field"], registry=r,
        )  # fmt: skip
        self.expected_wait = Gauge(
            "epd_llm_expected_wait_seconds",
            "When the last request to arrive would be done (admission's estimate)",
            registry=r,
        )
        self.admission_rate = Gauge(
            "epd_llm_admission_tokens_per_second",
            "Prompt plus sampled tokens per busy second (the seed until measured)",
            registry=r,
        )
        self.refusals = Gauge(
            "epd_llm_refusals_total", "Requests refused at admission, by reason", ["reason"], registry=r
        )
        self.kv_tier = Gauge(
            "epd_llm_kv_tier",
            "The KV tiers below the prefix cache: sizes and counters",
            ["tier", "field"],
            registry=r,
        )

    def render(self, engine: LLMEngine) -> bytes:
        s = engine.stats()
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.labels(pool="full").set(s.kv_full_usage)
        self.kv_usage.labels(pool="window").set(s.kv_window_usage)
        self.kv_usage.labels(pool="all").set(s.kv_pool_usage)
        self.tokens_per_s.set(s.tokens_per_s)
        self.gen_tokens.set(s.generation_tokens_total)
        self.prompt_tokens.set(s.prompt_tokens_total)
        self.cached_tokens.set(s.cached_prompt_tokens_total)
        self.spec.labels(field="draft_tokens_total").set(s.spec_draft_tokens_total)
        self.spec.labels(field="accepted_tokens_total").set(s.spec_accepted_tokens_total)
        self.spec.labels(field="acceptance_length").set(s.spec_acceptance_length)
        self.expected_wait.set(s.expected_wait_s)
        self.admission_rate.set(s.admission_tokens_per_s)
        for reason in ("wait", "memory"):
            self.refusals.labels(reason=reason).set(s.refusals.get(reason, 0))
        for tier, fields in engine.kv_tier_stats().items():
            for name, value in fields.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    self.kv_tier.labels(tier=tier, field=name).set(value)
        return generate_latest(self.registry)


def _sse(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


def create_app(
    engine: LLMEngine,
    config: LLMServerConfig | None = None,
    embeddings: EmbeddingSource | None = None,
) -> Starlette:
    """The starlette app over a constructed engine (started on app startup, stopped on shutdown)."""
    config = config or LLMServerConfig()
    metrics = _Metrics()
    served = config.served_model_names
    model_name = served[0]  # what responses report (vLLM's rule)
    chosen = engine.runner.model.backends  # chosen once, when the model was loaded
    paths = report(chosen.paths())  # what each chosen backend runs, and why where a stand-in runs
    backends = chosen.names()

    def guarded(fn: Handler) -> Handler:
        async def handler(request: Request) -> Response:
            try:
                resp = await fn(request)
            except Exception as exc:
                if not isinstance(exc, APIError):
                    log.exception("unhandled error in %s", request.url.path)
                resp = error_response(exc)
            metrics.requests.labels(status=str(resp.status_code)).inc()
            return resp

        return handler

    async def read_request(request: Request) -> CompletionRequest:
        return parse_completion_request(
            await request.body(),
            engine.tokenizer,
            engine.max_model_len,
            engine.model_config.vocab_size,
            request.headers.get("x-request-id"),
        )

    async def submit(
        req: CompletionRequest, deadline_s: float | None = None
    ) -> tuple[RequestStream, KVTransferReport | None]:
        """Queue the request; with ``kv_transfer`` ``{"export": true}`` its prompt's KV is handed
        over after the prefill, with ``{"import": handle, "first_token": id}`` it is taken in (or,
        when that fails, recomputed: the returned info says which)."""
        mm = []
        if req.refs:
            if embeddings is None:
                raise bad_request("this engine has no embedding source for multimodal requests", "multimodal")
            mm = await embeddings.resolve(req.refs)
        export, kv_import, info = False, None, None
        transfer: KVTransfer | None = req.kv_transfer
        if transfer is not None:
            if engine.handoff is None:
                raise bad_request(
                    "kv_transfer must be {'export': true} or {'import': handle, 'first_token': id} "
                    "on an engine with a KV transport",
                    "kv_transfer",
                )
            export = transfer.export
            if transfer.handle is not msgspec.UNSET:
                got = await engine.handoff.fetch(transfer.handle, transfer.first_token, req.prompt_ids)
                kv_import, info = got.kv_import, got.info
        try:
            stream = engine.submit(
                req.prompt_ids,
                req.sampling,
                mm,
                request_id=req.request_id,
                kv_import=kv_import,
                kv_export=export,
                deadline_s=deadline_s,
            )
        except EngineRequestError as e:
            raise bad_request(str(e), e.param) from e
        except EngineOverloaded as e:
            raise overloaded(str(e), retry_after_s=e.retry_after_s) from e
        return stream, info

    async def completions(request: Request) -> Response:
        req = await read_request(request)
        deadline = request_deadline_s(request.headers, engine.config.max_queue_wait_s)
        stream, info = await submit(req, deadline)
        if req.stream:
            return StreamingResponse(
                _events(req, stream, info),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await _collect(req, stream, request, info)

    async def _collect(
        req: CompletionRequest, stream: RequestStream, request: Request, info: KVTransferReport | None
    ) -> Response:
        """Wait for the whole completion; abort it if the client goes away meanwhile."""
        text: list[str] = []
        ids: list[int] = []
        reason: str | None = None
        cached = 0

        async def consume() -> None:
            nonlocal reason, cached
            async for out in stream:
                text.append(out.text)
                ids.extend(out.token_ids)
                reason = out.finish_reason
                cached = out.num_cached_tokens

        task = asyncio.ensure_future(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    stream.close()
                    return Response(status_code=499)
            task.result()
        finally:
            stream.close()
            export = engine.pop_export(req.request_id)
        if reason == "error":
            raise APIError(500, "the engine failed while running this request", type="internal_error")
        body = completion_body(req, model_name, "".join(text), ids, reason, cached)
        transfer_report = export if export is not None else info
        if transfer_report is not None:
            body.kv_transfer = transfer_report
        return Response(encode(body), media_type="application/json")

    async def _events(
        req: CompletionRequest, stream: RequestStream, info: KVTransferReport | None
    ) -> AsyncIterator[bytes]:
        first = True
        n_out = 0
        cached = 0
        try:
            async for out in stream:
                n_out = out.num_output_tokens
                cached = out.num_cached_tokens
                if out.finish_reason == "error":
                    yield _sse(error_body(500, "internal_error", "the engine failed on this request", None))
                    break
                # The first token always goes out, text or not: it starts the client's answer (a
                # streamed chat's role chunk), and the time to it is what admission bounds. Held-back
                # text (half a character, ids outside the tokenizer) would otherwise delay it.
                if out.text or out.finished or req.return_token_ids or first:
                    chunk = chunk_body(req, model_name, out.text, out.token_ids, out.finish_reason, first)
                    if first and info is not None:
                        chunk.kv_transfer = info  # how the prompt's KV arrived (or why not)
                    yield sse_event(chunk)
                    first = False
            if req.include_usage:
                final = chunk_body(req, model_name, "", [], None, False)
                final.choices = []
                final.usage = usage(len(req.prompt_ids), n_out, cached)
                yield sse_event(final)
            yield SSE_DONE
        finally:
            stream.close()  # no-op when finished; aborts on disconnect (generator closed early)
            engine.pop_export(req.request_id)

    async def models(request: Request) -> Response:
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "owned_by": "epd", "max_model_len": engine.max_model_len}
                    for name in served
                ],
            }
        )

    async def health(request: Request) -> Response:
        """The engine's state; ``?check_integrity=1`` also checks the KV bookkeeping (for fault
        tests and operators: it walks every page once)."""
        s = engine.stats()
        extra = {"integrity": engine.check_integrity()} if request.query_params.get("check_integrity") else {}
        load = engine.load()
        events = engine.kv_events
        return JSONResponse(
            {
                "status": "ok",
                "model": model_name,
                **s._asdict(),
                **load._asdict(),
                # what a router needs to name and match this engine's pages (llm_routing)
                "instance_id": engine.instance_id,
                "role": config.role,
                "kv_handoff": engine.handoff.stats() if engine.handoff else None,
                "kv_tiers": engine.kv_tier_stats(),
                "page_size": engine.kv.page_size,
                # the KV cache groups (llm_core.caches.kv_groups): spec, layers, pages and bytes
                "kv_groups": engine.kv.describe_groups(),
                # what they draw from: one shared block pool (or a pool per group) and its bytes
                "kv_pool": engine.kv.describe_pool(),
                "kv_events_endpoint": events.endpoint if events else None,
                "kv_events_replay_endpoint": events.replay_endpoint if events else None,
                **extra,
                **paths,
                "backends": backends,
            }
        )

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.render(engine), media_type="text/plain; version=0.0.4")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        freeze_startup_objects()  # the model is loaded: its objects need no collecting
        engine.start()
        try:
            yield
        finally:
            engine.stop()
            if embeddings is not None:
                await embeddings.close()

    return Starlette(
        routes=[
            Route("/v1/completions", guarded(completions), methods=["POST"]),
            Route("/v1/models", guarded(models), methods=["GET"]),
            Route("/health", guarded(health), methods=["GET"]),
            Route("/metrics", guarded(metrics_route), methods=["GET"]),
        ],
        lifespan=lifespan,
    )


def build_app(
    config: LLMServerConfig, open_cache: ReaderOpener | None = None, model_dir: Path | None = None
) -> Starlette:
    """Load the checkpoint and wire engine, embedding source and app. ``open_cache``: opens this
    node's embedding cache (the encoder's; None: ref URLs only); ``model_dir``: the checkpoint
    (default: ``config``'s; with neither, ValueError: the embedded default is written by a tools
    step, ``llm_core.tools.default_llm``, which ``epd llm`` runs)."""
    model_dir = model_dir or config.model_dir
    if model_dir is None:
        raise ValueError(
            "no checkpoint directory: epd llm writes the embedded default (llm_core.tools.default_llm)"
        )
    device = config.resolve_device()
    events = None
    if config.kv_events_endpoint:
        events = KVEventPublisher(config.kv_events_endpoint, config.kv_events_replay_endpoint)
    engine = LLMEngine.from_checkpoint(model_dir, config.engine, device, config.torch_dtype, kv_events=events)
    engine.handoff = KVHandoff(config.kv_transport, config.cache_namespace, engine.kv, host=config.host)
    store = build_store(config.store)
    if store is not None and engine.attach_kv_store(store, config.store.ttl_s) is None:
        log.warning(
            "a store is configured but the engine keeps no KV there: it needs a host tier "
            "(--engine-host-kv-bytes) and a kv store policy other than off"
        )
    embeddings = EmbeddingSource.open(
        open_cache, config.cache_namespace, engine.model_config.hidden_size, config.fetch_timeout_s
    )
    return create_app(engine, config, embeddings)


def serve_llm(
    config: LLMServerConfig, open_cache: ReaderOpener | None = None, model_dir: Path | None = None
) -> None:
    """Run the engine process until interrupted (``epd llm``, which passes the encoder's cache
    as ``open_cache`` and the checkpoint as ``model_dir``: see ``build_app``)."""
    import torch

    if config.torch_threads is not None:
        torch.set_num_threads(config.torch_threads)  # the process's own: the engine thread reads it
    app = build_app(config, open_cache, model_dir)
    serve_internal(app, uds=config.uds, host=config.host, port=config.port, log_level=config.log_level)
