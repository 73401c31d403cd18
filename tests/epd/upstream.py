"""An LLM server for the tests of what the ingress makes of its answers: a real aiohttp server on
loopback that answers ``POST /v1/completions`` with the given response, and an ``EngineClient`` of
it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from epd.engine_client import EngineClient


@asynccontextmanager
async def upstream(
    answer: Callable[[], web.Response], read_bufsize: int = 1 << 16
) -> AsyncIterator[EngineClient]:
    async def handler(request: web.Request) -> web.Response:
        return answer()

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    server = TestServer(app)
    await server.start_server()
    try:
        async with aiohttp.ClientSession(read_bufsize=read_bufsize) as session:
            yield EngineClient(session, str(server.make_url("")))
    finally:
        await server.close()
