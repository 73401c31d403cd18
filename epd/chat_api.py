"""``POST /v1/chat/completions`` (OpenAI format, with ``image_url`` and ``video_url`` parts) and a
pass-through ``POST /v1/completions``.

E → P → D: the media of all messages are resolved concurrently to EmbeddingRefs (cache or
encoder), the chat template expands each into a placeholder run of its token count, and the
engine receives token ids plus the refs in placeholder order; it reads the embeddings from the
node cache itself. Streaming re-frames the engine's completion chunks as chat chunks.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from epd.encode_api import read_json
from epd.ingress import Ingress
from epd.media_pipeline import EncodedItem
from epd.media_request import chat_prompt
from epd.prompt_format import ChatTemplateError, UnservedModality, media_item
from epd_common.admission import request_deadline_s
from epd_common.errors import APIError, bad_request, error_body, overloaded, unprocessable

# Sampling fields forwarded to the engine unchanged; the engine validates their values.
_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "return_token_ids",  # extension: the choice carries prompt_token_ids and token_ids
)


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: body[k] for k in _SAMPLING_FIELDS if k in body and body[k] is not None}
    if "max_completion_tokens" in body and "max_tokens" not in out:
        out["max_tokens"] = body["max_completion_tokens"]
    if body.get("n", 1) != 1:
        raise unprocessable("only n=1 is supported", "n")
    return out


def _media_usage(items: list[EncodedItem]) -> dict[str, int]:
    usage = {"image_tokens": 0, "video_tokens": 0, "images": 0, "videos": 0, "cached_media": 0}
    for it in items:
        kind = "image" if it.ref.modality == "image" else "video"
        usage[f"{kind}_tokens"] += it.ref.num_tokens
        usage[f"{kind}s"] += 1
        usage["cached_media"] += int(it.cache_hit)
    return usage


async def chat_completions(ingress: Ingress, request: Request) -> Response:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise unprocessable("the body must be a JSON object", "body")
    prompt = chat_prompt(body.get("messages"), ingress.config.max_items)
    try:
        ingress.prompt_format.check_parts(prompt.messages)  # before any media is fetched
    except UnservedModality as exc:
        raise APIError(415, str(exc), type="unsupported_media_type", param=exc.param) from exc
    except ChatTemplateError as exc:
        raise bad_request(str(exc), exc.param) from exc
    sampling = _sampling(body)
    stream = bool(body.get("stream", False))
    include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
    model = str(body.get("model") or ingress.config.model_name)
    engines = ingress.engines  # 404 early when no engine is configured

    if ingress.chats_inflight >= ingress.config.max_inflight_chats:  # a memory guard
        ingress.metrics.refusals.labels(stage="ingress", reason="memory").inc()
        raise overloaded(f"{ingress.chats_inflight} chat requests in flight; try again shortly")
    # One deadline for the whole chat: the media resolve against it, the engine gets what is left.
    deadline = request_deadline_s(request.headers, ingress.config.max_queue_wait_s)
    deadline_at = time.monotonic() + deadline
    ingress.chats_inflight += 1
    try:
        items = await ingress.pipeline.resolve_all(prompt.media, deadline) if prompt.media else []
    finally:
        ingress.chats_inflight -= 1
    media = [media_item(items[p["index"]].ref) for m in prompt.messages for p in m["content"] if "index" in p]
    try:
        prompt_ids = ingress.prompt_format.prompt_ids(prompt.messages, media)
    except ChatTemplateError as exc:  # the checkpoint's template refused these messages
        raise bad_request(str(exc), exc.param) from exc
    engine_body = {
        "prompt": prompt_ids,
        "multimodal": [it.ref.to_json() for it in items],
        **sampling,
    }
    keys = engines.cache_keys(prompt_ids, [(it.ref.key, it.ref.num_tokens) for it in items])
    media_usage = _media_usage(items)
    chat_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    if not stream:
        out = await engines.complete(engine_body, keys, deadline_at)
        choice = out["choices"][0]
        usage = {**out.get("usage", {}), **media_usage}
        return JSONResponse(
            {
                "id": chat_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": choice.get("text", "")},
                        "finish_reason": choice.get("finish_reason"),
                        **{k: choice[k] for k in ("prompt_token_ids", "token_ids") if k in choice},
                    }
                ],
                "usage": usage,
                "media": [{"name": it.name, "key": it.ref.key, "cache_hit": it.cache_hit} for it in items],
            }
        )

    # Validate the engine accepts the request before the 200 status line goes out.
    chunks = engines.stream({**engine_body, "stream_options": {"include_usage": True}}, keys, deadline_at)
    first = await anext(chunks, None)

    def frame(delta: dict[str, Any], finish: str | None) -> bytes:
        chunk = {
            "id": chat_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
        return f"data: {json.dumps(chunk)}\n\n".encode()

    async def events() -> AsyncIterator[bytes]:
        yield frame({"role": "assistant", "content": ""}, None)
        usage: dict[str, Any] | None = None
        pending = first
        try:
            while pending is not None:
                if pending.get("usage"):
                    usage = pending["usage"]
                for choice in pending.get("choices", []):
                    text = choice.get("text", "")
                    finish = choice.get("finish_reason")
                    if text or finish:
                        yield frame({"content": text} if text else {}, finish)
                pending = await anext(chunks, None)
        except APIError as exc:
            yield f"data: {json.dumps(error_body(exc.status, exc.type, exc.message, exc.param))}\n\n".encode()
        finally:
            await chunks.aclose()
        if include_usage:
            final = {
                "id": chat_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": {**(usage or {}), **media_usage},
            }
            yield f"data: {json.dumps(final)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def completions(ingress: Ingress, request: Request) -> Response:
    """Text (or token id) completions, passed to the engine as they are."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise unprocessable("the body must be a JSON object", "body")
    if "multimodal" in body:
        raise unprocessable("use /v1/chat/completions to send media", "multimodal")
    engines = ingress.engines
    keys = engines.cache_keys(body.get("prompt"))
    deadline_at = time.monotonic() + request_deadline_s(request.headers, ingress.config.max_queue_wait_s)
    if not body.get("stream"):
        return JSONResponse(await engines.complete(body, keys, deadline_at))
    chunks = engines.stream(body, keys, deadline_at)
    first = await anext(chunks, None)

    async def events() -> AsyncIterator[bytes]:
        pending = first
        try:
            while pending is not None:
                yield f"data: {json.dumps(pending)}\n\n".encode()
                pending = await anext(chunks, None)
        except APIError as exc:
            yield f"data: {json.dumps(error_body(exc.status, exc.type, exc.message, exc.param))}\n\n".encode()
        finally:
            await chunks.aclose()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
