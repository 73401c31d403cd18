"""Ingress health polling: encoder state goes through the router, which owns the ring."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

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


def test_the_vllm_backend_narrows_the_prompt_format_to_what_it_hands_on(mimo_v2_dir: Path) -> None:
    """A checkpoint whose audio epd serves, behind vLLM: the ingress's format (what chats are
    checked against) drops audio, and the backend renders with that same format."""
    namespace = f"test-ingress-narrow-{os.getpid()}"
    for backend, hears in (("epd", True), ("vllm", False)):
        ing = Ingress(
            IngressConfig(
                encoder_urls=("http://127.0.0.1:9",),
                llm_model_dir=str(mimo_v2_dir),
                llm_server=backend,  # type: ignore[arg-type]
                cache_namespace=namespace,
            )
        )
        try:
            assert ing.prompt_format.serves_audio
            made = ing._make_llm_server()
            assert ing.prompt_format.serves_audio is hears
            assert made.prompt_format is ing.prompt_format  # type: ignore[attr-defined]
        finally:
            ing.cache.close()
            shutil.rmtree(ing.cache.root, ignore_errors=True)
