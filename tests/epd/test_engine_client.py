"""What an upstream's refusal can make the ingress believe (epd/engine_client.py,
epd/server_pool/refusals.py): a Retry-After is bounded, a nan or a date is 1 s, and a refusal
ends when a health poll finds the queue empty."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from epd.engine_client import EngineClient
from epd.server_pool.refusals import MAX_WAIT_S, RefusalClock
from epd_common.errors import APIError
from tests.epd.upstream import upstream


async def _refusal(retry_after: str) -> APIError:
    body = {"error": {"type": "overloaded", "message": "busy"}}
    answer = lambda: web.json_response(body, status=503, headers={"Retry-After": retry_after})  # noqa: E731
    async with upstream(answer) as client:
        with pytest.raises(APIError) as info:
            await client.complete({"prompt": [1]})
        return info.value


@pytest.mark.parametrize(
    ("header", "want"),
    [
        ("86400", MAX_WAIT_S),
        ("nan", 1.0),
        ("inf", 1.0),
        ("-5", 0.0),
        ("Wed, 21 Oct 2026 07:28:00 GMT", 1.0),
        ("3", 3.0),
    ],
)
def test_a_retry_after_is_bounded(header: str, want: float) -> None:
    exc = asyncio.run(_refusal(header))
    assert exc.status == 503 and exc.retry_after_s == want


def test_a_refusal_is_bounded_and_cleared() -> None:
    now = [0.0]
    clock = RefusalClock(lambda: now[0])
    clock.note("a", 86400.0)
    assert clock.wait_s("a") == MAX_WAIT_S
    clock.note("b", float("nan"))
    assert clock.wait_s("b") == 1.0
    now[0] = 30.0
    assert clock.wait_s("a") == MAX_WAIT_S - 30.0
    clock.clear("a")
    assert clock.wait_s("a") == 0.0 and clock.least(["a", "b"]) == 0.0


async def _answer(body: bytes, stream: bool, content_type: str = "text/event-stream") -> APIError:
    async with upstream(
        lambda: web.Response(body=body, content_type=content_type), read_bufsize=1 << 12
    ) as client:
        with pytest.raises(APIError) as info:
            if stream:
                [c async for c in client.stream({"prompt": [1]})]
            else:
                await client.complete({"prompt": [1]})
        return info.value


@pytest.mark.parametrize(
    "body",
    [
        b"data: {not json\n\n",
        b"data: [1, 2]\n\n",
        b'data: {"error": "boom"}\n\n',
        b'data: {"error": {"code": "x", "message": "boom"}}\n\n',
        b'data: {"choices": [{"text": "' + b"a" * (1 << 14) + b'"}]}\n\n',  # over 2 x read_bufsize
    ],
    ids=["not-json", "not-object", "error-not-object", "error-code-not-int", "line-too-long"],
)
def test_a_malformed_stream_is_a_502_naming_the_server(body: bytes) -> None:
    exc = asyncio.run(_answer(body, stream=True))
    assert exc.status == 502 and exc.type == "upstream_error"
    if "error" not in body.decode(errors="replace")[:20]:
        assert "the LLM server sent" in exc.message


@pytest.mark.parametrize("body", [b"not json", b"[1]", b"{}", b'{"choices": []}', b'{"choices": ["x"]}'])
def test_a_malformed_answer_is_a_502_naming_the_server(body: bytes) -> None:
    exc = asyncio.run(_answer(body, stream=False, content_type="application/json"))
    assert exc.status == 502 and "the LLM server sent" in exc.message and "choices" in exc.message


def test_a_4xx_error_event_keeps_its_status() -> None:
    body = b'data: {"error": {"code": 400, "message": "too long", "type": "invalid_request_error"}}\n\n'
    exc = asyncio.run(_answer(body, stream=True))
    assert (exc.status, exc.message) == (400, "too long")


def test_an_unreachable_server_is_named_by_label_not_address() -> None:
    """Client-facing errors name the server as the pool numbers it; its host and port go to the
    log only."""
    from epd.llm_servers.vllm_launch import free_port

    async def run() -> APIError:
        async with aiohttp.ClientSession() as session:
            client = EngineClient(session, f"http://127.0.0.1:{free_port()}")
            client.label = "LLM server 2"
            with pytest.raises(APIError) as info:
                await client.complete({"prompt": [1]})
            return info.value

    exc = asyncio.run(run())
    assert exc.status == 503 and "LLM server 2" in exc.message and "127.0.0.1" not in exc.message
