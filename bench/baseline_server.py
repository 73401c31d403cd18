"""The "before" encode service the QPS benchmark compares against.

What a straightforward first version does per request, one request after another:

    download (aiohttp) ─▶ PIL decode ─▶ transformers' Qwen2VLImageProcessor ─▶ batch-of-one forward

No embedding cache, no cross-request batching, no overlap of one request's download with another's
compute: a lock serialises whole requests, and the CPU stages run on the event loop itself. It
loads the same encoder as the service (the embedded default, or ``--model DIR``)
and speaks the same request shape (``POST /v1/encode`` with JSON ``{"items": [{"url": ...}]}``), so
the load generator drives both identically. Images only.

It runs with the allocator setting of epd's processes (``epd.allocator.keep_freed_memory``).
Run it alone (the benchmark starts it as a subprocess with one uvicorn worker)::

    python -m bench.baseline_server --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import torch
from PIL import Image, ImageOps
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from encoder.models.checkpoint import load_encoder
from epd.allocator import keep_freed_memory
from media_io.config import PreprocessConfig


class BaselineEncoder:
    """Model + processor + one HTTP session; ``encode_url`` does one item start to finish."""

    def __init__(
        self, preprocess: PreprocessConfig = PreprocessConfig(), model_path: str | None = None
    ) -> None:
        from transformers import Qwen2VLImageProcessor

        loaded = load_encoder(model_path)
        self.model = loaded.model.eval()
        self.fingerprint = loaded.fingerprint
        self.processor = Qwen2VLImageProcessor(
            min_pixels=preprocess.min_pixels,
            max_pixels=preprocess.max_pixels,
            patch_size=preprocess.patch_size,
            temporal_patch_size=preprocess.temporal_patch_size,
            merge_size=preprocess.merge_size,
            image_mean=list(preprocess.image_mean),
            image_std=list(preprocess.image_std),
        )
        self.session: aiohttp.ClientSession | None = None
        self.lock = asyncio.Lock()
        self.served = 0

    async def encode_url(self, url: str) -> dict[str, Any]:
        assert self.session is not None, "the app's lifespan opens the session"
        t0 = time.perf_counter()
        async with self.session.get(url) as resp:
            resp.raise_for_status()
            data = await resp.read()
        t1 = time.perf_counter()
        img = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
        t2 = time.perf_counter()
        inputs = self.processor(images=[img], return_tensors="pt")
        t3 = time.perf_counter()
        with torch.inference_mode():
            emb = self.model(inputs["pixel_values"], inputs["image_grid_thw"])  # [tokens, out_hidden]
        t4 = time.perf_counter()
        self.served += 1
        return {
            "num_tokens": int(emb.shape[0]),
            "grid_thw": [int(v) for v in inputs["image_grid_thw"][0]],
            "cache_hit": False,
            "timings_ms": {
                "download": (t1 - t0) * 1e3,
                "decode": (t2 - t1) * 1e3,
                "preprocess": (t3 - t2) * 1e3,
                "forward": (t4 - t3) * 1e3,
            },
        }


def build_app(preprocess: PreprocessConfig = PreprocessConfig(), model_path: str | None = None) -> Starlette:
    enc = BaselineEncoder(preprocess, model_path)

    async def encode(request: Request) -> Response:
        try:
            items = (await request.json())["items"]
            urls = [str(it["url"]) for it in items]
        except (ValueError, KeyError, TypeError) as exc:
            return JSONResponse({"error": {"type": "bad_request", "message": repr(exc)}}, status_code=400)
        async with enc.lock:  # whole requests one after another: the "before" has no overlap
            try:
                data = [await enc.encode_url(u) for u in urls]
            except (aiohttp.ClientError, OSError, ValueError) as exc:
                msg = f"{type(exc).__name__}: {exc}"
                return JSONResponse({"error": {"type": "bad_media", "message": msg}}, status_code=400)
        return JSONResponse({"object": "list", "data": data})

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok", "fingerprint": enc.fingerprint, "served": enc.served})

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        enc.session = aiohttp.ClientSession()
        try:
            yield
        finally:
            await enc.session.close()

    return Starlette(
        routes=[
            Route("/v1/encode", encode, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/ready", health, methods=["GET"]),
        ],
        lifespan=lifespan,
    )


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    parser = argparse.ArgumentParser(allow_abbrev=False, description="the baseline (before) encode service")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument(
        "--model", default=None, help="encoder checkpoint directory (default: the embedded one)"
    )
    args = parser.parse_args(argv)
    # The allocator setting every epd process starts with: a process-wide knob any service could
    # use, so the baseline gets it too rather than paying page faults ours does not.
    keep_freed_memory()
    uvicorn.run(
        build_app(model_path=args.model), host=args.host, port=args.port, workers=1, log_level="warning"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
