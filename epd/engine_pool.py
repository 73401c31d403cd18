"""The LLM engines the ingress serves chats from, and the routing of each request to one of them.

    request ──cache keys (prompt ids, media runs as their MediaKeys' pseudo-ids)──▶ LLMRouter.route
       ──▶ Dispatch (the router's load counters) ──POST /v1/completions, X-Request-Id──▶ engine
       ◀── chunks: the first one moves the dispatch from prefill to decode load; the usage's
           cached_tokens is the engine's actual hit, compared with the router's prediction

With engines of split roles (``epd llm --role prefill|decode``) a request goes through two::

    prefill engine (chosen by affinity) ── max_tokens 1, kv_transfer export ──▶ first token + KV handle
    decode engine (chosen by load)      ── kv_transfer import + first token ──▶ the answer, streamed
    (no prefill engine reachable, or its export failed: the decode engine computes the prompt)

Each router's engines are a ``ServerPool`` (``epd.server_pool``) with the router as its policy;
one ``Liveness`` covers every engine (an engine of role "both" is in both pools). A dispatch ends
however the request ends (done, an error, the client gone): its ``finish`` runs in a ``finally``.
An engine that cannot be reached before it answered anything is taken out of the routing set and
the request goes to the next choice of its router (it has produced nothing, so nothing is lost or
doubled); an engine that refused it for load passes it on the same way, and when every engine
refused the client gets the shortest wait one named. An engine that fails mid-answer fails that
request only. The engine admits against the request's deadline itself, so the pool does not pass
a refusing engine by (the encoder ring does). The health loop
(``poll``) feeds every engine's /health to the router: page geometry, its KV events endpoint,
the requests it holds (the correction of lost decrements) and whether it is up.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import aiohttp
import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from epd.engine_body import EngineBody, includes_usage
from epd.engine_body import max_tokens as body_max_tokens
from epd.engine_client import EngineClient
from epd.llm_routing.llm_router import LLMRouter
from epd.llm_routing.load_counters import Dispatch
from epd.llm_routing.page_naming import RoutingPrompt
from epd.llm_routing.policy import RouterConfig
from epd.llm_servers.cache_keys import prompt_cache_keys
from epd.server_pool import (
    AllAttemptsFailed,
    AttemptFailure,
    Liveness,
    NoServerAvailable,
    Outcome,
    PoolConfig,
    RefusalClock,
    ServerPool,
    Verdict,
)
from epd.server_pool.attempts import FATAL, UNREACHABLE, refused
from epd_common.admission import seconds_left
from epd_common.errors import APIError
from epd_common.messages.completion_request import CompletionRequestBody, KVTransfer
from epd_common.messages.completion_response import KVTransferReport, kv_transfer_report
from llm_core.prompts.tokenizer import Tokenizer

log = logging.getLogger("epd.engine_pool")
T = TypeVar("T")

COMPLETIONS = "/v1/completions"

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RoutingMetrics:
    """What ``/metrics`` shows of the routing: per engine requests, load and the hit drift."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.routed = Counter("epd_llm_routed", "Requests routed to each engine", ["engine"], registry=r)
        self.engine_up = Gauge(
            "epd_llm_engine_up", "1 while an engine is in the routing set", ["engine"], registry=r
        )
        self.load_tokens = Gauge(
            "epd_llm_engine_load_tokens", "Router-counted load per engine", ["engine", "phase"], registry=r
        )
        self.load_spread = Gauge("epd_llm_load_spread", "Max over mean load of the live engines", registry=r)
        self.predicted = Counter(
            "epd_llm_predicted_cached_tokens",
            "Prompt tokens the router predicted cached",
            ["engine"],
            registry=r,
        )
        self.actual = Counter(
            "epd_llm_actual_cached_tokens", "Prompt tokens the engine reported cached", ["engine"], registry=r
        )
        self.ttft = Histogram(
            "epd_llm_ttft_seconds",
            "Time to the first engine chunk",
            ["engine"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.refused = Counter(
            "epd_llm_engine_refusals",
            "Engine refusals for load the pool saw (the request went to the next engine, or got 503)",
            registry=r,
        )
        self.failovers = Counter(
            "epd_llm_failovers", "Requests re-routed because an engine could not be reached", registry=r
        )
        self.kv_bytes = Counter(
            "epd_llm_kv_transfer_bytes", "Prompt KV bytes moved prefill -> decode", registry=r
        )
        self.kv_seconds = Histogram(
            "epd_llm_kv_transfer_seconds", "Fetch time of a prompt's KV on the decode engine", registry=r
        )
        self.kv_fallbacks = Counter(
            "epd_llm_kv_transfer_fallbacks",
            "Split requests whose decode engine recomputed the prompt, by reason",
            ["reason"],
            registry=r,
        )


class RouteRequest(NamedTuple):
    """What an LLM router chooses an engine by."""

    prompt: RoutingPrompt | Sequence[int]  # ids + media spans (plain ids: no media)
    num_prompt_tokens: int
    max_tokens: int


class _Routed:
    """An LLM router as a pool's policy: each attempt is a new dispatch, with its own request id."""

    def __init__(self, router: LLMRouter, metrics: RoutingMetrics) -> None:
        self.router = router
        self.metrics = metrics

    def choose(self, request: RouteRequest, candidates: Sequence[str]) -> Dispatch:
        rid = f"epd-{uuid.uuid4().hex[:24]}"
        dispatch = self.router.route(
            request.prompt, request.num_prompt_tokens, request.max_tokens, rid, among=candidates
        )
        self.metrics.routed.labels(engine=dispatch.url).inc()
        return dispatch


class _Lane(NamedTuple):
    """One router and the pool of its engines (the prefill or only one; the decode one)."""

    router: LLMRouter
    pool: ServerPool[RouteRequest, Dispatch]


class _Opened(NamedTuple):
    """A stream that produced its first chunk (None: it ended without one)."""

    dispatch: Dispatch
    chunks: AsyncGenerator[dict[str, Any], None]
    first: dict[str, Any] | None
    started: float


class EnginePool:
    """Engine clients over one aiohttp session, and the routers that choose among them."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        urls: Sequence[str],
        tokenizer: Tokenizer,
        router_config: RouterConfig,
        registry: CollectorRegistry,
        timeout_s: float = 600.0,
        roles: Sequence[str] = (),
        make_client: Callable[[aiohttp.ClientSession, str, float], EngineClient] | None = None,
    ) -> None:
        """``roles[i]``: "prefill", "decode" or "both" (default) for ``urls[i]``; ``make_client``:
        the server kind's client of one server (default: our engine's)."""
        roles = tuple(roles) or ("both",) * len(urls)
        if len(roles) != len(urls) or any(r not in ("prefill", "decode", "both") for r in roles):
            raise ValueError(f"one role of prefill/decode/both per engine url, got {roles} for {list(urls)}")
        self.roles = dict(zip(urls, roles, strict=True))
        make = make_client or (lambda s, u, t: EngineClient(s, u, timeout_s=t))
        self.clients = {u: make(session, u, timeout_s) for u in urls}
        for i, client in enumerate(self.clients.values()):
            client.label = f"LLM server {i + 1}"  # what answers to clients call it (not its URL)
        self.split = any(r != "both" for r in roles)
        prefill = [u for u in urls if self.roles[u] != "decode"]
        decode = [u for u in urls if self.roles[u] != "prefill"]
        if self.split and not (prefill and decode):
            raise ValueError(f"split roles need a prefill and a decode engine, got {self.roles}")
        self.tokenizer = tokenizer
        self.metrics = RoutingMetrics(registry)
        # An engine is routed to once a poll (or a check) found it up; a failed call or poll takes
        # it out at once, the next poll that finds it up puts it back.
        self.liveness = Liveness(urls, label="LLM engine", fall_after=1, rise_after=1, initially_up=False)
        self.liveness.subscribe(
            lambda url, up: self.metrics.engine_up.labels(engine=url).set(1.0 if up else 0.0)
        )
        self.refusals = RefusalClock()
        # Prefill engines by affinity (their prefix caches are what a hit saves); decode engines by
        # load (the KV arrives with the request, whatever they cache).
        self.lane = self._lane(prefill, router_config)
        self.decode_lane = (
            self._lane(decode, dataclasses.replace(router_config, policy="least_load"))
            if self.split
            else None
        )
        self.healths: dict[str, dict[str, Any]] = {}

    def _lane(self, urls: list[str], config: RouterConfig) -> _Lane:
        router = LLMRouter(urls, config, liveness=self.liveness)
        pool: ServerPool[RouteRequest, Dispatch] = ServerPool(
            self.liveness,
            _Routed(router, self.metrics),
            _engine_verdict,
            PoolConfig("LLM engine"),
            members=urls,
            refusals=self.refusals,
            on_failure=self._count_failure,
        )
        return _Lane(router, pool)

    @property
    def router(self) -> LLMRouter:
        """The prefill (or only) router: by affinity."""
        return self.lane.router

    @property
    def decode_router(self) -> LLMRouter | None:
        """Split roles: the decode engines' router, by load."""
        return None if self.decode_lane is None else self.decode_lane.router

    @property
    def routers(self) -> list[LLMRouter]:
        return [self.router] + ([self.decode_router] if self.decode_router is not None else [])

    def start(self) -> None:
        for r in self.routers:
            r.start()

    def close(self) -> None:
        for r in self.routers:
            r.close()

    # -- health ------------------------------------------------------------------------------
    async def poll(self) -> None:
        """One /health round over every engine (one that answers is up, one that does not is down):
        the routers learn geometry, events and load."""
        healths: dict[str, dict[str, Any]] = {}

        async def probe(url: str) -> bool:
            health = await self.clients[url].health()  # None when down, after its own timeout
            if health is not None:
                healths[url] = health
            return health is not None

        await self.liveness.check_all(probe, timeout_s=None)
        for url, health in healths.items():
            self.healths[url] = health
            queued = health.get("num_prefill_tokens", health.get("num_waiting_tokens", 0))
            if not queued:  # up, nothing waiting (or a server that does not say): refusal over
                self.refusals.clear(url)
            for r in self._routers_of(url):
                r.on_health(url, health)
        stats = self.router.stats()
        self.metrics.load_spread.set(stats.load_spread)
        for r in self.routers:
            for e in r.stats().engines:
                self.metrics.load_tokens.labels(engine=e.url, phase="prefill").set(e.load.prefill_tokens)
                self.metrics.load_tokens.labels(engine=e.url, phase="decode").set(e.load.decode_tokens)

    def _routers_of(self, url: str) -> list[LLMRouter]:
        return [r for r in self.routers if url in r.engine_urls]

    def mark(self, url: str, live: bool) -> None:
        """Put an engine in or out of routing (a failed poll or call, the supervisor's view)."""
        if url in self.clients:
            self.liveness.set(url, live)

    @property
    def up(self) -> dict[str, bool]:
        """Engine url -> whether it is in the routing set."""
        return self.liveness.states

    @property
    def any_up(self) -> bool:
        if self.split:
            assert self.decode_lane is not None
            return bool(self.decode_lane.pool.live_members)
        return bool(self.lane.pool.live_members)

    def expected_wait_s(self) -> float:
        """The shortest wait a live engine a request enters through would give it now, from the
        engines' last refusals counted down (``RefusalClock``; 0 while none refused lately). The
        ingress refuses a chat whose deadline this exceeds before it parses, resolves or renders
        anything: the engines would refuse it anyway, and under overload that work is what delays
        the admitted chats' first tokens."""
        return self.lane.pool.expected_wait_s()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"router": self.router.stats(), "split": self.split}
        if self.decode_router is not None:
            out["decode_router"] = self.decode_router.stats()
        return out

    # -- requests ----------------------------------------------------------------------------
    def cache_keys(self, prompt: Any, media: Sequence[tuple[str, int, str]] = ()) -> list[int]:
        """The keys the engine's prefix cache will match the prompt on (``prompt_cache_keys``)."""
        return prompt_cache_keys(self.tokenizer, prompt, media)

    async def complete(
        self,
        body: EngineBody,
        keys: RoutingPrompt | Sequence[int],
        deadline_at: float | None = None,
        path: str = COMPLETIONS,
        prompt_tokens: int | None = None,
    ) -> dict[str, Any]:
        """A non-streamed completion (through a prefill and a decode engine when roles are split).
        ``deadline_at`` (monotonic): each engine is told what is left of it (``X-Request-Timeout``)."""
        if self.decode_lane is None:
            out, _ = await self._complete_on(
                self.lane, body, keys, deadline_at=deadline_at, path=path, prompt_tokens=prompt_tokens
            )
            return out
        pre = await self._prefill(_split_body(body), keys, deadline_at)
        if pre.done is not None:
            return pre.done
        out, _ = await self._complete_on(
            self.decode_lane, pre.decode_body, keys, pre, deadline_at=deadline_at
        )
        return _with_prefill_usage(out, pre)

    async def stream(
        self,
        body: EngineBody,
        keys: RoutingPrompt | Sequence[int],
        deadline_at: float | None = None,
        path: str = COMPLETIONS,
        prompt_tokens: int | None = None,
        relay: bool = False,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Streamed chunks (the decode engine's when roles are split); re-routes only before the
        first chunk. ``relay``: token chunks stay undecoded bytes (``StreamedChunk.opaque``)."""
        if self.decode_lane is None:
            chunks = self._stream_on(
                self.lane,
                body,
                keys,
                deadline_at=deadline_at,
                path=path,
                prompt_tokens=prompt_tokens,
                relay=relay,
            )
            async for chunk in chunks:
                yield chunk
            return
        pre = await self._prefill(_split_body(body), keys, deadline_at)
        if pre.done is not None:
            for chunk in _as_chunks(pre.done, body):
                yield chunk
            return
        async for chunk in self._stream_on(self.decode_lane, pre.decode_body, keys, pre, deadline_at):
            yield _with_prefill_usage(chunk, pre) if chunk.get("usage") else chunk

    async def _prefill(
        self, body: CompletionRequestBody, keys: RoutingPrompt | Sequence[int], deadline_at: float | None
    ) -> _Prefilled:
        """Run the prompt on a prefill engine (one token, KV exported); what the decode engine
        is to be sent. With no prefill engine reachable, the decode engine gets the plain body."""
        want = body.max_tokens
        pre_body = msgspec.structs.replace(
            body,
            stream=None,
            stream_options=None,
            max_tokens=1,
            return_token_ids=True,
            kv_transfer=KVTransfer(export=True),
        )
        try:
            out, url = await self._complete_on(
                self.lane, pre_body, keys, max_tokens=1, deadline_at=deadline_at
            )
        except APIError as exc:
            if not _unreachable(exc):
                raise  # the prompt itself was refused: the decode engine would refuse it too
            log.warning("no prefill engine answered (%s); the decode engine computes the prompt", exc.message)
            self.metrics.kv_fallbacks.labels(reason="prefill_unavailable").inc()
            return _Prefilled(None, body, None, None)
        choice = out["choices"][0]
        first = list(choice.get("token_ids") or [])
        if choice.get("finish_reason") == "stop" or want == 1 or not first:
            if not body.return_token_ids:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
            out.pop("kv_transfer", None)
            return _Prefilled(out, body, None, out.get("usage"))
        export = kv_transfer_report(out.get("kv_transfer"))
        decode_body = body
        if export is not None and export.handle is not None:
            handoff = KVTransfer(handle=export.handle, first_token=first[0])
            decode_body = msgspec.structs.replace(body, kv_transfer=handoff)
        else:
            reason = export.error if export is not None and export.error else "no_export"
            self.metrics.kv_fallbacks.labels(reason=reason).inc()
        return _Prefilled(None, decode_body, url, out.get("usage"))

    async def _complete_on(
        self,
        lane: _Lane,
        body: EngineBody,
        keys: RoutingPrompt | Sequence[int],
        pre: _Prefilled | None = None,
        max_tokens: int | None = None,
        deadline_at: float | None = None,
        path: str = COMPLETIONS,
        prompt_tokens: int | None = None,
    ) -> tuple[dict[str, Any], str]:
        """The engine's body and which engine answered."""

        async def attempt(dispatch: Dispatch) -> tuple[dict[str, Any], str]:
            started = time.perf_counter()
            client = self.clients[dispatch.url]
            try:
                out = await client.complete(body, dispatch.request_id, seconds_left(deadline_at), path)
            finally:
                dispatch.finish()
            transfer = kv_transfer_report(out.get("kv_transfer"))
            self._record(lane.router, dispatch, out.get("usage") or {}, transfer, pre, started)
            if pre is not None:
                out.pop("kv_transfer", None)
            return out, dispatch.url

        return await self._call(lane, _route_request(body, keys, max_tokens, prompt_tokens), attempt)

    async def _stream_on(
        self,
        lane: _Lane,
        body: EngineBody,
        keys: RoutingPrompt | Sequence[int],
        pre: _Prefilled | None = None,
        deadline_at: float | None = None,
        path: str = COMPLETIONS,
        prompt_tokens: int | None = None,
        relay: bool = False,
    ) -> AsyncGenerator[dict[str, Any], None]:
        async def open_stream(dispatch: Dispatch) -> _Opened:
            """An attempt ends at the first chunk: until then another engine may take over."""
            started = time.perf_counter()
            chunks = self.clients[dispatch.url].stream(
                body, dispatch.request_id, seconds_left(deadline_at), path, relay
            )
            try:
                first = await anext(chunks, None)
            except BaseException:
                dispatch.finish()
                await chunks.aclose()
                raise
            return _Opened(dispatch, chunks, first, started)

        request = _route_request(body, keys, None, prompt_tokens)
        dispatch, chunks, chunk, started = await self._call(lane, request, open_stream)
        usage: dict[str, Any] = {}
        transfer: KVTransferReport | None = None
        try:
            if chunk is not None:
                dispatch.first_token()
                self.metrics.ttft.labels(engine=dispatch.url).observe(time.perf_counter() - started)
                transfer = kv_transfer_report(chunk.pop("kv_transfer", None))
            while chunk is not None:
                if getattr(chunk, "opaque", False):
                    n = 1  # a relayed token chunk (undecoded): one token, as vLLM streams them
                else:
                    n = sum(_output_tokens(c) for c in chunk.get("choices", []))
                dispatch.add_output_tokens(int(n))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                yield chunk
                chunk = await anext(chunks, None)  # the client has chunks already: no failover now
        finally:
            dispatch.finish()
            await chunks.aclose()
        self._record(lane.router, dispatch, usage, transfer, pre, started)

    async def _call(
        self, lane: _Lane, request: RouteRequest, attempt: Callable[[Dispatch], Awaitable[T]]
    ) -> T:
        """``attempt`` on the engines of ``lane`` with failover; what the client gets when none
        answered: every refusal's shortest wait once an engine refused, the last engine's error
        otherwise, a 503 when no engine is up at all."""
        try:
            return await lane.pool.call(request, attempt)
        except NoServerAvailable as exc:
            raise APIError(503, str(exc), type="engine_unavailable", retry_after_s=2.0) from exc
        except AllAttemptsFailed as exc:
            refusals = [a.error for a in exc.refusals if isinstance(a.error, APIError)]
            if refusals:
                raise _all_refused(refusals) from exc
            raise exc.attempts[-1].error from None

    def _count_failure(self, failure: AttemptFailure, moving_on: bool) -> None:
        if failure.verdict.outcome is Outcome.REFUSED:
            self.metrics.refused.inc()
        elif failure.verdict.outcome is Outcome.UNREACHABLE and moving_on:
            self.metrics.failovers.inc()

    def _record(
        self,
        router: LLMRouter,
        dispatch: Dispatch,
        usage: dict[str, Any],
        transfer: KVTransferReport | None,
        pre: _Prefilled | None,
        started: float,
    ) -> None:
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        if isinstance(cached, int) and pre is None:  # the decode engine's own hits are not routed on
            router.record_actual(dispatch, cached)
            self.metrics.predicted.labels(engine=dispatch.url).inc(dispatch.predicted_cached_tokens)
            self.metrics.actual.labels(engine=dispatch.url).inc(cached)
        moved = ""
        if pre is not None and transfer is not None:
            if transfer.imported:
                self.metrics.kv_bytes.inc(transfer.bytes)
                self.metrics.kv_seconds.observe(transfer.seconds)
                moved = f", KV from {pre.prefill_url}: {transfer.bytes} bytes in {transfer.seconds:.4f} s"
            else:
                self.metrics.kv_fallbacks.labels(reason=str(transfer.reason)).inc()
                moved = f", KV import failed ({transfer.reason}): prompt recomputed"
        log.info(
            "request %s: engine %s, prompt %d tokens, cached predicted %d / actual %s%s, %.3f s",
            dispatch.request_id,
            dispatch.url,
            dispatch.prompt_tokens,
            dispatch.predicted_cached_tokens,
            cached,
            moved,
            time.perf_counter() - started,
        )


class _Prefilled(NamedTuple):
    done: dict[str, Any] | None  # the whole answer already (the first token ended it)
    decode_body: CompletionRequestBody  # what the decode engine is sent
    prefill_url: str | None
    prefill_usage: dict[str, Any] | None


def _with_prefill_usage(out: dict[str, Any], pre: _Prefilled) -> dict[str, Any]:
    """The prompt's cached tokens are the prefill engine's (the decode engine computed none)."""
    usage, p = out.get("usage"), pre.prefill_usage
    if isinstance(usage, dict) and isinstance(p, dict) and "prompt_tokens_details" in p:
        usage["prompt_tokens_details"] = p["prompt_tokens_details"]
    return out


def _split_body(body: EngineBody) -> CompletionRequestBody:
    """The body of a split request: the P/D hand-off runs between epd's own engines only."""
    assert isinstance(body, CompletionRequestBody), (
        f"a split request is epd's engine's, not a {type(body).__name__}"
    )
    return body


def _as_chunks(out: dict[str, Any], body: EngineBody) -> list[dict[str, Any]]:
    """A finished completion as the stream a client asked for: one chunk, then the usage."""
    chunk = {k: v for k, v in out.items() if k != "usage"}
    chunks = [chunk]
    if includes_usage(body) and out.get("usage"):
        chunks.append({**chunk, "choices": [], "usage": out["usage"]})
    return chunks


def _output_tokens(choice: dict[str, Any]) -> int:
    """Tokens one streamed choice carries (its ids when sent; else 1 for any text, as a completion's
    ``text`` or a chat's ``delta.content``)."""
    ids = choice.get("token_ids")
    if ids:
        return len(ids)
    return int(bool(choice.get("text") or (choice.get("delta") or {}).get("content")))


def _route_request(
    body: EngineBody,
    keys: RoutingPrompt | Sequence[int],
    max_tokens: int | None,
    prompt_tokens: int | None,
) -> RouteRequest:
    """``prompt_tokens``: the prompt's size when ``keys`` do not give it (a server kind that routes by
    load only sends none)."""
    if max_tokens is None:
        want = body_max_tokens(body)
        max_tokens = 16 if want is None else want
    size = len(keys.token_ids) if isinstance(keys, RoutingPrompt) else len(keys)
    return RouteRequest(keys, prompt_tokens or size or 1, max_tokens)


def _engine_verdict(error: BaseException) -> Verdict:
    """An engine that refused for load or could not be reached is worth the next engine; any
    other error is the request's own (a 4xx) and reaches the client."""
    if isinstance(error, APIError):
        if _refused(error):
            return refused(error.retry_after_s)
        if _unreachable(error):
            return UNREACHABLE
    return FATAL


def _refused(exc: APIError) -> bool:
    """The engine refused the request for load (503 or 429 with its expected wait)."""
    return exc.status in (429, 503) and exc.type == "overloaded"


def _all_refused(refusals: list[APIError]) -> APIError:
    """Every engine tried refused for load: 503 with the shortest wait one of them named."""
    waits = [r.retry_after_s for r in refusals if r.retry_after_s is not None]
    detail = "; ".join(r.message for r in refusals)
    return APIError(
        503,
        f"all {len(refusals)} LLM engines refused for load: {detail}",
        type="overloaded",
        retry_after_s=min(waits) if waits else 1.0,
    )


def _unreachable(exc: APIError) -> bool:
    """The engine could not be reached (or crashed): the client's engine_unavailable 503."""
    return exc.status == 503 and exc.type == "engine_unavailable"
