"""EncodeReply on the wire: the worker's JSON body, decoded strictly by the ingress; a worker that
answers 200 with something else is unavailable (the ring tries the next), not the client's 4xx."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import msgspec
import pytest
from aiohttp import web

from epd.encoder_client import EncoderClient
from epd.encoder_router import WorkerUnavailable
from epd_common.messages.embedding_ref import EmbeddingRef
from epd_common.messages.encode_reply import EncodeReply

REF = EmbeddingRef(key="ab" * 32, dtype="float32", shape=(4, 8), grid_thw=((1, 4, 4),))


def test_the_body_is_the_json_object_the_ingress_reads() -> None:
    reply = EncodeReply(REF, True, {"forward": 1.5})
    body = json.loads(reply.encode())
    assert body == {"ref": REF.to_json(), "cache_hit": True, "timings_ms": {"forward": 1.5}}
    assert EncodeReply.decode(reply.encode()) == reply
    assert EncodeReply.decode(json.dumps({"ref": REF.to_json()}).encode()) == EncodeReply(REF)


@pytest.mark.parametrize(
    "body",
    [b"not json", b"{}", json.dumps({"ref": {**REF.to_json(), "shape": "4x8"}}).encode(), b"[1]"],
)
def test_a_reply_that_does_not_fit_is_refused_naming_why(body: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        EncodeReply.decode(body)


def test_a_worker_answering_200_with_garbage_is_unavailable() -> None:
    async def main() -> None:
        async def encode(request: web.Request) -> web.Response:
            return web.Response(body=b'{"ref": {"key": 3}}', content_type="application/json")

        app = web.Application()
        app.router.add_post("/encode", encode)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as session:
                with pytest.raises(WorkerUnavailable, match="not an EncodeReply"):
                    await EncoderClient(session).encode(f"http://127.0.0.1:{port}", b"x", "image", "img")
        finally:
            await runner.cleanup()

    asyncio.run(main())
