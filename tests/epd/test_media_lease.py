"""A chat's media stay in the node cache from the ingress resolving them to the engine reading them
(``epd.media_lease``), through the real ingress app in this process.

    TestClient ──▶ ingress (real: pipeline, lease, chat route, engine pool)
                     ├──▶ fake encoder worker (thread): keys the bytes as a worker does and puts a
                     │    fixed-size embedding into the node cache (a hook stands in for the puts
                     │    of other requests on the node)
                     └──▶ fake engine (thread): reads the refs with the engine's own
                          ``EmbeddingSource`` from the node cache, as ``epd llm`` does

Every entry has the same size; the node cache holds two of them (and a little slack).
"""

from __future__ import annotations

import base64
import io
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import uvicorn
from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from encoder.caches.cache_format import PAGE
from encoder.caches.embed_cache import CacheFull, EmbedCache
from encoder.caches.media_key import media_key
from epd.config import IngressConfig
from epd.ingress_app import build_app
from epd_common.errors import CACHE_FULL, ENTRY_BYTES_HEADER, APIError, error_body
from epd_common.messages.completion_response import (
    SSE_DONE,
    CompletionChoice,
    CompletionChunk,
    encode,
    sse_event,
    usage,
)
from epd_common.messages.embedding_ref import EmbeddingRef
from epd_common.messages.encode_reply import EncodeReply
from llm_core.serving.embedding_source import EmbeddingSource
from media_io.config import PreprocessConfig
from tests.epd.conftest import free_port
from tests.uvicorn_thread import serve_in_thread

FINGERPRINT = "fp-lease-test"
ROWS, HIDDEN = 16, 64
ENTRY = PAGE + ROWS * HIDDEN * 4
CAPACITY = 2 * ENTRY + ENTRY // 2


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (8, 8, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def key_of(data: bytes) -> str:
    return media_key(data, "image", PreprocessConfig(), FINGERPRINT)


def chat(*images: bytes, stream: bool = False) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(d).decode()}}
        for d in images
    ]
    parts.append({"type": "text", "text": "what is it?"})
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 4, "stream": stream}


@dataclass
class Node:
    """The fake roles around one real ingress, and the node cache they share."""

    cache: EmbedCache  # the test's own open of the node cache
    client: TestClient
    # called with the key a worker is about to put (the puts of other requests go here)
    before_put: list[Callable[[str], object]] = field(default_factory=list)
    engine_calls: int = 0
    before_read: list[Callable[[list[EmbeddingRef]], object]] = field(default_factory=list)

    def other_put(self, seed: int) -> str:
        """What an encode of another request, on another worker of the node, writes."""
        key = key_of(png(seed))
        self.cache.put(key, torch.zeros(ROWS, HIDDEN), [(1, 8, 8)], "image", "other")
        return key


def _worker(node: list[Node], worker_cache: EmbedCache) -> Starlette:
    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok", "fingerprint": FINGERPRINT, "audio": None})

    async def encode(request: Request) -> Response:
        data = await request.body()
        item = request.query_params.get("item")
        key = key_of(data)
        for hook in node[0].before_put:
            hook(key)
        try:
            ref = worker_cache.put(key, torch.ones(ROWS, HIDDEN), [(1, 8, 8)], "image", "worker")
        except CacheFull as e:  # as the real worker answers it (tests/encoder/serving)
            headers = {"Retry-After": "1", ENTRY_BYTES_HEADER: str(e.needed_bytes)}
            return JSONResponse(error_body(503, CACHE_FULL, str(e), item), status_code=503, headers=headers)
        return Response(EncodeReply(ref).encode(), media_type="application/json")

    async def embedding(request: Request) -> Response:  # a worker's answer for an evicted entry
        return JSONResponse(error_body(404, "not_found", "gone", "key"), status_code=404)

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/encode", encode, methods=["POST"]),
            Route("/embeddings/{key}", embedding),
        ]
    )


def _engine(node: list[Node], engine_cache: EmbedCache) -> Starlette:
    source = EmbeddingSource(engine_cache, HIDDEN)

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def completions(request: Request) -> Response:
        node[0].engine_calls += 1
        body = msgspec.json.decode(await request.body())
        refs = [EmbeddingRef.from_json(r) for r in body.get("multimodal", [])]
        for hook in node[0].before_read:
            hook(refs)
        try:
            await source.resolve(refs)
        except APIError as e:
            headers = {"Retry-After": "1"} if e.retry_after_s is not None else None
            return JSONResponse(
                error_body(e.status, e.type, e.message, e.param), status_code=e.status, headers=headers
            )
        # the engine's own answer schema (what the ingress decodes)
        answer = CompletionChunk(
            id="cmpl-0",
            created=0,
            model="m",
            choices=[CompletionChoice(text="a picture", finish_reason="stop")],
            usage=usage(len(body["prompt"]), 1),
        )
        if body.get("stream"):
            return Response(sse_event(answer) + SSE_DONE, media_type="text/event-stream")
        return Response(encode(answer), media_type="application/json")

    return Starlette(
        routes=[Route("/health", health), Route("/v1/completions", completions, methods=["POST"])]
    )


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    namespace = f"test-lease-{os.getpid()}"
    cache = EmbedCache(namespace, capacity_bytes=CAPACITY)
    shutil.rmtree(cache.root / "entries", ignore_errors=True)  # a clean node
    cache.close()
    cache = EmbedCache(namespace, capacity_bytes=CAPACITY)
    worker_cache, engine_cache = EmbedCache(namespace), EmbedCache(namespace)
    holder: list[Node] = []
    w_port, e_port = free_port(), free_port()
    try:
        with (
            serve_in_thread(
                uvicorn.Config(_worker(holder, worker_cache), port=w_port, log_level="warning"), "worker"
            ),
            serve_in_thread(
                uvicorn.Config(_engine(holder, engine_cache), port=e_port, log_level="warning"), "engine"
            ),
        ):
            config = IngressConfig(
                encoder_urls=(f"http://127.0.0.1:{w_port}",),
                llm_urls=(f"http://127.0.0.1:{e_port}",),
                cache_namespace=namespace,
                cache_capacity_bytes=CAPACITY,
            )
            with TestClient(build_app(config)) as client:
                holder.append(Node(cache, client))
                yield holder[0]
    finally:
        for c in (cache, worker_cache, engine_cache):
            c.close()
        shutil.rmtree(cache.root, ignore_errors=True)


def post(node: Node, body: dict[str, Any]) -> Any:
    return node.client.post("/v1/chat/completions", json=body)


def test_media_that_cannot_fit_the_node_cache_are_a_413_before_any_engine_work(node: Node) -> None:
    r = post(node, chat(png(1), png(2), png(3)))  # three entries, room for two
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["type"] == "media_too_large"
    assert f"holds {CAPACITY} bytes" in err["message"] and "--cache-capacity-bytes" in err["message"]
    assert "need at least" in err["message"]
    assert node.engine_calls == 0
    # every lease of the refused request is gone: the cache takes two new entries
    node.other_put(11)
    node.other_put(12)
    # the same medium twice is one entry: two distinct ones fit
    r = post(node, chat(png(1), png(2), png(1)))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_items_that_fit_are_not_evicted_by_puts_of_other_requests(node: Node, stream: bool) -> None:
    a, b = png(21), png(22)
    assert post(node, chat(a)).status_code == 200  # a is cached (and no longer leased)
    # While b is encoded, another request's item is written on the node: the cache is full, and a
    # (the least recently used) is what b's put would evict without the request's lease on it.
    node.before_put.append(lambda key: node.other_put(23) if key == key_of(b) else None)
    r = post(node, chat(a, b, stream=stream))
    assert r.status_code == 200, r.text
    if stream:
        assert b'"error"' not in r.content and r.content.endswith(b"data: [DONE]\n\n"), r.content
    else:
        assert [m["cache_hit"] for m in r.json()["media"]] == [True, False]
    assert node.cache.contains(key_of(a)) and node.cache.contains(key_of(b))
    assert not node.cache.contains(key_of(png(23)))  # the other request's item went instead
    # the answer is out: the leases are released, and a and b are evictable again
    node.before_put.clear()
    node.other_put(24)
    node.other_put(25)
    assert not node.cache.contains(key_of(a)) and not node.cache.contains(key_of(b))


def test_a_cache_held_by_other_requests_leases_is_a_retryable_503(node: Node) -> None:
    held = [node.other_put(31), node.other_put(32)]
    with node.cache.lease(held, ttl_s=60):  # another request's media, in use
        r = post(node, chat(png(33)))
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == CACHE_FULL and r.headers["Retry-After"]
        assert node.engine_calls == 0
        assert all(node.cache.contains(k) for k in held)
    assert post(node, chat(png(33))).status_code == 200  # released: there is room again


def test_an_item_evicted_anyway_is_the_engines_retryable_503(node: Node) -> None:
    # what no lease can stop: an explicit eviction (``epd cache evict``) before the engine reads
    node.before_read.append(lambda refs: [node.cache.evict(r.key) for r in refs])
    r = post(node, chat(png(41)))
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "embedding_evicted" and err["param"] == "multimodal[0]"
    assert r.headers["Retry-After"]
