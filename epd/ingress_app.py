"""The ingress HTTP app: routes, error mapping, request metrics and lifecycle."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from epd import chat_api, encode_api
from epd.body_limit import BodyLimitMiddleware
from epd.config import IngressConfig
from epd.ingress import Ingress
from epd_common.errors import APIError, error_body, error_response
from epd_common.runtime import freeze_startup_objects
from media_io.errors import MediaError

Handler = Callable[[Ingress, Request], Awaitable[Response]]


def build_app(config: IngressConfig) -> Starlette:
    ingress = Ingress(config)

    def bind(handler: Handler, route: str) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            t0 = time.perf_counter()
            ingress.metrics.inflight.inc()
            status = 500
            try:
                response = await handler(ingress, request)
                status = response.status_code
                return response
            except (APIError, MediaError) as exc:
                status = exc.status
                raise
            finally:
                ingress.metrics.inflight.dec()
                ingress.metrics.requests.labels(route=route, status=str(status)).inc()
                ingress.metrics.request_seconds.labels(route=route).observe(time.perf_counter() - t0)

        return endpoint

    async def health(ing: Ingress, __: Request) -> Response:
        # Answers from memory only, so it stays fast under full load (the roles' paths are from
        # the last health poll).
        admission = {
            "inflight_items": ing.pipeline.inflight,
            "expected_wait_s": round(ing.pipeline.expected_wait_s(1), 4),
            "items_per_s": round(ing.pipeline.rate.per_s(), 2),
            "rate_measured": ing.pipeline.rate.measured,
        }
        # the event loop's stalls: the worst since start and over the last 5 s (epd_common.loop_lag)
        lag = {
            "worst": round(ing.loop_lag.worst_s * 1e3, 1),
            "last_5s": round(ing.loop_lag.recent_worst_s(5.0) * 1e3, 1),
        }
        return JSONResponse(
            {
                "status": "ok",
                "admission": admission,
                "loop_lag_ms": lag,
                **ing.active_paths(),
                "llm_routing": ing.routing_stats(),
            }
        )

    async def ready(ing: Ingress, _: Request) -> Response:
        up = len(ing.router.live_workers)
        engine_ok = ing.engine_up or not ing.config.llm_urls
        body = {"encoders_up": up, "encoders": len(ing.router.workers), "engine_up": ing.engine_up}
        return JSONResponse(
            {"ready": bool(up and engine_ok), **body}, status_code=200 if up and engine_ok else 503
        )

    async def metrics(ing: Ingress, _: Request) -> Response:
        return Response(ing.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(ing: Ingress, _: Request) -> Response:
        # every served id (epd.served_model); `root` is the checkpoint, as vLLM's model cards say
        root = ing.config.llm_model_dir
        models = [
            {"id": name, "object": "model", "created": 0, "owned_by": "epd", "root": root or name}
            for name in ing.config.served_model_names
        ]
        return JSONResponse({"object": "list", "data": models})

    async def index(_: Ingress, __: Request) -> Response:
        page = resources.files("epd").joinpath("static/index.html").read_text(encoding="utf-8")
        return HTMLResponse(page)

    routes = [
        Route("/", bind(index, "/"), methods=["GET"]),
        Route("/health", bind(health, "/health"), methods=["GET"]),
        Route("/ready", bind(ready, "/ready"), methods=["GET"]),
        Route("/metrics", bind(metrics, "/metrics"), methods=["GET"]),
        Route("/v1/models", bind(models, "/v1/models"), methods=["GET"]),
        Route("/v1/encode", bind(encode_api.encode, "/v1/encode"), methods=["POST"]),
        Route("/v1/embeddings/{key}", bind(encode_api.embedding, "/v1/embeddings"), methods=["GET"]),
        Route(
            "/v1/chat/completions", bind(chat_api.chat_completions, "/v1/chat/completions"), methods=["POST"]
        ),
        Route("/v1/completions", bind(chat_api.completions, "/v1/completions"), methods=["POST"]),
    ]

    async def on_error(_: Request, exc: Exception) -> Response:
        if isinstance(exc, MediaError):  # media_io's errors carry their own status and kind
            body = error_body(exc.status, exc.kind, exc.message, exc.item)
            return JSONResponse(body, status_code=exc.status)
        return error_response(exc)

    async def on_http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(
            error_body(exc.status_code, "http_error", str(exc.detail), None), status_code=exc.status_code
        )

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await ingress.start()
        freeze_startup_objects()
        try:
            yield
        finally:
            await ingress.stop()

    app = Starlette(
        routes=routes,
        middleware=[Middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes)],
        exception_handlers={
            APIError: on_error,
            MediaError: on_error,
            HTTPException: on_http_error,
            Exception: on_error,
        },
        lifespan=lifespan,
    )
    app.state.ingress = ingress
    return app
