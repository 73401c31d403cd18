"""What the ingress does per streamed token: the engine's chunk is decoded once and keeps its bytes
when the pool does not rewrite it, chat chunks are spliced from bytes fixed per request, and the
chat template runs off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from aiohttp import web

from epd.chat_api import ChatFrames, _passed_through
from epd.engine_client import StreamedChunk
from epd.llm_servers.epd_engine import EpdEngineServer
from epd_common.errors import APIError
from epd_common.messages.completion_request import CompletionRequestBody
from tests.epd.upstream import upstream

TOKEN = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "choices": [{"text": "é"}]}
USAGE = {**TOKEN, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
FIRST = {**TOKEN, "kv_transfer": {"imported": True}}


def sse(*events: object) -> bytes:
    return b"".join(
        b"data: " + (e if isinstance(e, bytes) else json.dumps(e, ensure_ascii=False).encode()) + b"\n\n"
        for e in events
    )


async def stream_from(body: bytes, relay: bool = False) -> list[StreamedChunk]:
    async with upstream(lambda: web.Response(body=body, content_type="text/event-stream")) as client:
        return [c async for c in client.stream({"prompt": [1]}, relay=relay)]


def test_chunks_keep_the_engine_bytes_unless_the_pool_rewrites_them() -> None:
    chunks = asyncio.run(stream_from(sse(FIRST, TOKEN, USAGE, b"[DONE]", TOKEN)))
    assert chunks == [FIRST, TOKEN, USAGE]  # nothing after [DONE]
    first, token, usage = chunks
    assert first.raw is None and usage.raw is None  # kv_transfer, usage: re-encoded from the dict
    assert token.raw == json.dumps(TOKEN, ensure_ascii=False).encode()
    assert _passed_through(token) == b"data: " + token.raw + b"\n\n"
    assert json.loads(_passed_through(usage)[6:]) == USAGE


def test_an_error_event_raises() -> None:
    error = {"error": {"type": "internal_error", "message": "boom", "param": None, "code": 500}}
    with pytest.raises(APIError, match="boom"):
        asyncio.run(stream_from(sse(TOKEN, error)))


def test_chat_frames_are_the_json_of_the_chunk() -> None:
    frame = ChatFrames("chatcmpl-1", 42, 'a "model"').frame
    for delta, finish in (
        ({"role": "assistant", "content": ""}, None),
        ({"content": "ü\n"}, None),
        ({}, "stop"),
    ):
        event = frame(delta, finish)
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        assert json.loads(event[6:]) == {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 42,
            "model": 'a "model"',
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }


CHAT_TOKEN = {
    "id": "chatcmpl-vllm",
    "object": "chat.completion.chunk",
    "created": 7,
    "model": "served",
    "system_fingerprint": None,
    "choices": [{"index": 0, "delta": {"content": 'say "usage":{ and "error"'}, "finish_reason": None}],
}
CHAT_USAGE = {**CHAT_TOKEN, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}


def test_a_relayed_stream_decodes_only_the_usage_and_errors() -> None:
    """Token chunks stay bytes (opaque, even when their text spells the keys epd looks for); the
    usage chunk is decoded; an error event still raises."""
    token, usage = asyncio.run(stream_from(sse(CHAT_TOKEN, CHAT_USAGE, b"[DONE]"), relay=True))
    assert (
        token.opaque
        and dict(token) == {}
        and token.raw == json.dumps(CHAT_TOKEN, ensure_ascii=False).encode()
    )
    assert not usage.opaque and usage == CHAT_USAGE
    error = {"error": {"type": "internal_error", "message": "boom", "param": None, "code": 500}}
    with pytest.raises(APIError, match="boom"):
        asyncio.run(stream_from(sse(CHAT_TOKEN, error), relay=True))


def test_a_relayed_chat_chunk_is_the_servers_choices_under_our_id() -> None:
    frames = ChatFrames("chatcmpl-ours", 42, 'a "model"')
    raw = json.dumps(CHAT_TOKEN, ensure_ascii=False).encode()
    event = frames.relayed(raw)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert raw.split(b'"choices":', 1)[1] in event  # the choices byte for byte
    assert json.loads(event[6:]) == {
        "id": "chatcmpl-ours",
        "object": "chat.completion.chunk",
        "created": 42,
        "model": 'a "model"',
        "choices": CHAT_TOKEN["choices"],
    }
    assert frames.relayed(b'{"odd": 1}') == b'data: {"odd": 1}\n\n'


class _Format:
    """The chat template and tokenizer as the backend calls them, recording the threads they ran on."""

    image_token_id = None
    video_token_id = None

    def __init__(self) -> None:
        self.tokenizer = self
        self.threads: list[threading.Thread] = []

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], media: Sequence[object]) -> list[int]:
        self.threads.append(threading.current_thread())
        return [1, 2, 3]

    def encode_text(self, text: str) -> list[int]:
        self.threads.append(threading.current_thread())
        return [ord(c) for c in text]


def test_the_chat_template_and_tokenizer_run_off_the_event_loop() -> None:
    fmt = _Format()
    backend = EpdEngineServer(fmt)  # type: ignore[arg-type]

    async def calls() -> threading.Thread:
        chat = await backend.chat_call(
            [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], [], {}
        )
        assert isinstance(chat.body, CompletionRequestBody)  # the Struct the engine decodes
        assert chat.body.prompt == [1, 2, 3] and list(chat.routing.token_ids) == [1, 2, 3]
        completion = await backend.completion_call({"prompt": "ab"})  # tokenized for its cache keys
        assert list(completion.routing.token_ids) == [97, 98]
        await backend.close()
        return threading.current_thread()

    loop_thread = asyncio.run(calls())
    assert len(fmt.threads) == 2 and all(t is not loop_thread for t in fmt.threads)
