"""``POST /v1/chat/completions`` (OpenAI format, with ``image_url`` and ``video_url`` parts) and a
pass-through ``POST /v1/completions``.

E → P → D: the media of all messages are resolved concurrently to EmbeddingRefs (cache or
encoder); the language-model server (``epd.llm_servers``: our engine, or vLLM) turns the
messages and refs into its server's request, and its answer into a ``ChatResult`` or a stream of
``ChatDelta``s, which this module frames as OpenAI chat responses with epd's media usage added.

Per streamed token the ingress does no JSON work beyond decoding the engine's chunk once
(``EngineClient.stream``; epd's engine's chunk is then read as its Struct, a ~1 us convert): a chat
chunk is spliced from bytes fixed for the request and the encoded delta (``ChatFrames``), and a
completion chunk passes through as the engine wrote it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from epd.client_fields import allowed_fields, check_fields
from epd.engine_body import with_usage
from epd.engine_client import StreamedChunk
from epd.http import read_json
from epd.ingress import Ingress
from epd.media_pipeline import EncodedItem
from epd.media_request import MediaSource, chat_prompt
from epd.prompt_format import ChatTemplateError, UnservedModality
from epd.served_model import resolve_model
from epd_common.admission import request_deadline_s
from epd_common.errors import APIError, bad_request, error_body, overloaded, unprocessable

# Fields of a chat body that are not the server's sampling: the ingress reads them itself.
_NOT_SAMPLING = frozenset({"messages", "model", "stream", "stream_options", "n", "best_of", "user"})


def _sampling(body: dict[str, Any], server: str) -> dict[str, Any]:
    """The sampling fields the LLM server gets unchanged (``client_fields`` has checked the
    names and bounds; the server validates the values)."""
    fields = allowed_fields(server, chat=True) - _NOT_SAMPLING - {"max_completion_tokens"}
    out = {k: body[k] for k in fields if k in body and body[k] is not None}
    if "max_completion_tokens" in body and "max_tokens" not in out:
        out["max_tokens"] = body["max_completion_tokens"]
    return out


def _media_usage(items: list[EncodedItem], sources: list[MediaSource]) -> dict[str, int]:
    """Tokens and items per modality; a video's audio track adds its tokens to ``audio_tokens``
    but is no audio item of its own."""
    usage = {k: 0 for k in ("image_tokens", "video_tokens", "audio_tokens", "images", "videos", "audios")}
    usage["cached_media"] = 0
    for it, src in zip(items, sources, strict=True):
        kind = it.ref.modality if it.ref.modality in ("image", "audio") else "video"
        usage[f"{kind}_tokens"] += it.ref.num_tokens
        usage[f"{kind}s"] += int(not src.audio_track)
        usage["cached_media"] += int(it.cache_hit)
    return usage


def _refuse_past_deadline(ingress: Ingress, deadline_s: float) -> None:
    """503 with Retry-After now when every engine's last refusal, counted down, is still past the
    request's deadline (``EnginePool.expected_wait_s``): before any parsing, fetching or rendering."""
    behind = ingress.engines.expected_wait_s()
    if behind > deadline_s:
        ingress.metrics.refusals.labels(stage="engine", reason="wait").inc()
        raise overloaded(
            f"every LLM engine is {behind:.1f} s behind (from its last refusal), past the {deadline_s:g} s deadline",
            retry_after_s=behind,
        )


async def chat_completions(ingress: Ingress, request: Request) -> Response:
    body = await read_json(request, ingress.config.max_json_body_bytes)
    if not isinstance(body, dict):
        raise unprocessable("the body must be a JSON object", "body")
    check_fields(body, ingress.llm_server.name, chat=True)
    model = resolve_model(ingress.config, body.get("model"))
    # One deadline for the whole chat: the media resolve against it, the engine gets what is left.
    deadline = request_deadline_s(request.headers, ingress.config.max_queue_wait_s)
    deadline_at = time.monotonic() + deadline
    _refuse_past_deadline(ingress, deadline)
    prompt = chat_prompt(
        body.get("messages"), ingress.config.max_items, audio=ingress.prompt_format.serves_audio
    )
    try:
        ingress.prompt_format.check_parts(prompt.messages)  # before any media is fetched
    except UnservedModality as exc:
        raise APIError(415, str(exc), type="unsupported_media_type", param=exc.param) from exc
    except ChatTemplateError as exc:
        raise bad_request(str(exc), exc.param) from exc
    sampling = _sampling(body, ingress.llm_server.name)
    stream = bool(body.get("stream", False))
    want_ids = bool(body.get("return_token_ids"))
    include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
    engines = ingress.engines  # 404 early when no engine is configured

    if ingress.chats_inflight >= ingress.config.max_inflight_chats:  # a memory guard
        ingress.metrics.refusals.labels(stage="ingress", reason="memory").inc()
        raise overloaded(f"{ingress.chats_inflight} chat requests in flight; try again shortly")
    # The items' entries stay leased in the node cache until the engine has answered (or failed):
    # no put of any process evicts them meanwhile (``epd.media_lease``).
    held = ingress.pipeline.lease_for(deadline) if prompt.media else None
    release = held.release if held is not None else _nothing
    passed_on = False  # a stream releases when it ends
    try:
        ingress.chats_inflight += 1
        try:
            items = await ingress.pipeline.resolve_all(prompt.media, deadline, held) if prompt.media else []
        finally:
            ingress.chats_inflight -= 1
        server = ingress.llm_server
        call = await server.chat_call(prompt.messages, items, sampling)
        media_usage = _media_usage(items, prompt.media)
        chat_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if not stream:
            out = await engines.complete(call.body, call.routing, deadline_at, call.path, call.prompt_tokens)
            result = server.chat_result(out)
            ids = {"prompt_token_ids": result.prompt_token_ids, "token_ids": result.token_ids}
            return FastJSONResponse(
                {
                    "id": chat_id,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": result.text},
                            "finish_reason": result.finish_reason,
                            **({k: v for k, v in ids.items() if v is not None} if want_ids else {}),
                        }
                    ],
                    "usage": {**result.usage, **media_usage},
                    "media": [
                        {"name": it.name, "key": it.ref.key, "cache_hit": it.cache_hit} for it in items
                    ],
                }
            )

        # Validate the engine accepts the request before the 200 status line goes out.
        relay = call.relay  # the server's chunks are chat chunks already: bytes through
        chunks = engines.stream(
            with_usage(call.body),
            call.routing,
            deadline_at,
            call.path,
            call.prompt_tokens,
            relay=relay,
        )
        first = await anext(chunks, None)
        frames = ChatFrames(chat_id, created, model)
        frame = frames.frame

        async def events() -> AsyncIterator[bytes]:
            if not relay:  # a relayed stream's first chunk is the server's own role chunk
                yield frame({"role": "assistant", "content": ""}, None)
            usage: dict[str, Any] | None = None
            pending = first
            try:
                while pending is not None:
                    if isinstance(pending, StreamedChunk) and pending.opaque and pending.raw is not None:
                        yield frames.relayed(pending.raw)
                        pending = await anext(chunks, None)
                        continue
                    delta = server.chat_delta(pending)
                    if delta.usage:
                        usage = delta.usage
                    if delta.text or delta.finish_reason:
                        yield frame({"content": delta.text} if delta.text else {}, delta.finish_reason)
                    pending = await anext(chunks, None)
            except APIError as exc:
                yield _error_event(exc)
            finally:
                await chunks.aclose()
                release()
            if include_usage:
                final = {
                    "id": chat_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": {**(usage or {}), **media_usage},
                }
                yield b"data: " + msgspec.json.encode(final) + b"\n\n"
            yield b"data: [DONE]\n\n"

        response = StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(release),  # also when the stream never started
        )
        passed_on = True
        return response
    finally:
        if not passed_on:
            release()


def _nothing() -> None:
    return None


async def completions(ingress: Ingress, request: Request) -> Response:
    """Text (or token id) completions, passed to the engine as they are."""
    body = await read_json(request, ingress.config.max_json_body_bytes)
    if not isinstance(body, dict):
        raise unprocessable("the body must be a JSON object", "body")
    if "multimodal" in body:
        raise unprocessable("use /v1/chat/completions to send media", "multimodal")
    check_fields(body, ingress.llm_server.name, chat=False)
    model = resolve_model(ingress.config, body.get("model"))
    engines = ingress.engines
    deadline = request_deadline_s(request.headers, ingress.config.max_queue_wait_s)
    deadline_at = time.monotonic() + deadline
    _refuse_past_deadline(ingress, deadline)
    call = await ingress.llm_server.completion_call(body)
    if not body.get("stream"):
        # the served id the client asked by, whatever the LLM server calls its model
        return FastJSONResponse(
            {
                **await engines.complete(call.body, call.routing, deadline_at, call.path, call.prompt_tokens),
                "model": model,
            }
        )
    chunks = engines.stream(call.body, call.routing, deadline_at, call.path, call.prompt_tokens)
    first = await anext(chunks, None)

    async def events() -> AsyncIterator[bytes]:
        pending = first
        try:
            while pending is not None:
                yield _passed_through(pending)
                pending = await anext(chunks, None)
        except APIError as exc:
            yield _error_event(exc)
        finally:
            await chunks.aclose()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class FastJSONResponse(Response):
    """A JSON answer encoded by msgspec (starlette's ``JSONResponse`` runs the standard library's
    encoder, several times slower on an answer's dicts, on the event loop)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return msgspec.json.encode(content)


class ChatFrames:
    """The SSE events of one streamed chat: every chunk shares its id, creation time and model, so
    those bytes are encoded once and each token's event is spliced from them and its delta."""

    def __init__(self, chat_id: str, created: int, model: str) -> None:
        enc = msgspec.json.encode
        self._prefix = b'data: {"id":%s,"object":"chat.completion.chunk","created":%d,"model":%s,' % (
            enc(chat_id),
            created,
            enc(model),
        )
        self._head = self._prefix + b'"choices":[{"index":0,"delta":'

    def frame(self, delta: Mapping[str, str], finish: str | None) -> bytes:
        enc = msgspec.json.encode
        return self._head + enc(delta) + b',"finish_reason":' + enc(finish) + b"}]}\n\n"

    def relayed(self, chunk: bytes) -> bytes:
        """A server's own chat chunk as this chat's: its id, creation time and model replaced by
        ours, its choices (and anything after them) byte for byte. A chunk without top-level
        choices (not what an OpenAI server sends) goes as it came."""
        at = chunk.find(b'"choices":')
        if at < 0:
            return b"data: " + chunk + b"\n\n"
        return self._prefix + chunk[at:] + b"\n\n"


def _passed_through(chunk: dict[str, Any]) -> bytes:
    """A completion chunk as the client gets it: the engine's own bytes when it kept them."""
    raw = chunk.raw if isinstance(chunk, StreamedChunk) else None
    return b"data: " + (raw if raw is not None else msgspec.json.encode(chunk)) + b"\n\n"


def _error_event(exc: APIError) -> bytes:
    return b"data: " + msgspec.json.encode(error_body(exc.status, exc.type, exc.message, exc.param)) + b"\n\n"
