"""Where the engine reads a request's embeddings (``EmbeddingSource``): an entry evicted between the
ingress resolving it and this read is a retryable 503 ``embedding_evicted`` naming the item; the
request's own faults keep their 400."""

from __future__ import annotations

import asyncio
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from safetensors.torch import save as save_safetensors

from encoder.caches.embed_cache import EmbedCache
from epd_common.errors import APIError
from epd_common.messages.embedding_ref import EmbeddingRef
from llm_core.serving.embedding_source import EmbeddingSource

HIDDEN = 8
GOOD = save_safetensors({"embedding": torch.ones(3, HIDDEN)})


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        status, body = {"/gone": (404, b"{}"), "/broken": (500, b"{}")}.get(self.path, (200, GOOD))
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def ref(key: str, url: str | None = None, rows: int = 3) -> EmbeddingRef:
    return EmbeddingRef(key=key, dtype="float32", shape=(rows, HIDDEN), grid_thw=((1, 2, 6),), url=url)


def resolve(cache: EmbedCache | None, refs: list[EmbeddingRef]) -> Any:
    async def run() -> Any:
        source = EmbeddingSource(cache, HIDDEN)
        try:
            return await source.resolve(refs)
        finally:
            await source.close()

    return asyncio.run(run())


def error_of(cache: EmbedCache | None, refs: list[EmbeddingRef]) -> APIError:
    with pytest.raises(APIError) as ei:
        resolve(cache, refs)
    return ei.value


def test_an_evicted_item_is_a_retryable_503_naming_it(tmp_path: Path, base_url: str) -> None:
    cache = EmbedCache("t", root=tmp_path / "cache")
    kept = cache.put("kept", torch.zeros(3, HIDDEN), [(1, 2, 6)], "image")
    cache.put("evicted", torch.zeros(3, HIDDEN), [(1, 2, 6)], "image")
    cache.evict("evicted")  # what a put of another request did before the engine read it
    for refs in ([kept, ref("evicted")], [kept, ref("evicted", f"{base_url}/gone")]):
        err = error_of(cache, refs)
        assert (err.status, err.type, err.param) == (503, "embedding_evicted", "multimodal[1]"), err.message
        assert err.retry_after_s is not None and "evicted" in err.message
    # no node cache here at all: a ref without url, or whose url is gone, is the same case
    assert error_of(None, [ref("k", f"{base_url}/gone")]).type == "embedding_evicted"
    cache.close()


def test_the_requests_own_faults_keep_their_codes(tmp_path: Path, base_url: str) -> None:
    cache = EmbedCache("t", root=tmp_path / "cache")
    cached = cache.put("cached", torch.zeros(3, HIDDEN), [(1, 2, 6)], "image")
    wrong_rows = msgspec.structs.replace(cached, shape=(4, HIDDEN))
    for refs, status in (
        ([wrong_rows], 400),  # shape mismatch, from the cache
        ([ref("remote", f"{base_url}/ok", rows=4)], 400),  # shape mismatch, from the url
        ([ref("remote", f"{base_url}/broken")], 400),  # a url that fails otherwise: as before
    ):
        err = error_of(cache, refs)
        assert (err.status, err.param) == (status, "multimodal[0]"), err.message
    (got,) = resolve(cache, [ref("remote", f"{base_url}/ok")])
    assert torch.equal(got.embedding, torch.ones(3, HIDDEN))
    cache.close()
