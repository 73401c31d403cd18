"""Ingress health polling: encoder state goes through the router, which owns the ring."""

from __future__ import annotations

import asyncio
import os
import shutil

import aiohttp
from aiohttp import web

from epd.config import IngressConfig
from epd.encoder_client import EncoderClient
from epd.ingress import Ingress

FINGERPRINT = "fp-test"


def test_poll_brings_back_a_worker_that_a_connection_error_took_out() -> None:
    answer = {"fingerprint": FINGERPRINT}

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", **answer})

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/health", health)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        live, dead = f"http://127.0.0.1:{port}", "http://127.0.0.1:9"
        namespace = f"test-ingress-{os.getpid()}"
        ing = Ingress(IngressConfig(encoder_urls=(live, dead), cache_namespace=namespace))
        try:
            async with aiohttp.ClientSession() as session:
                ing.encoder_client = EncoderClient(session)
                ing.fingerprint = FINGERPRINT
                await ing.poll_health()
                assert ing.router.live_workers == [live]
                # A call that could not connect takes the worker out at once...
                ing.router.mark_down(live)
                assert ing.router.live_workers == []
                # ...and the next poll that finds it healthy puts it back.
                await ing.poll_health()
                assert ing.router.live_workers == [live]
                # A worker serving another model (fingerprint) is not part of this deployment.
                answer["fingerprint"] = "other-model"
                await ing.poll_health()
                assert ing.router.live_workers == []
        finally:
            ing.cache.close()
            shutil.rmtree(ing.cache.root, ignore_errors=True)
            await runner.cleanup()

    asyncio.run(main())
