"""The engine's HTTP server: completions (JSON and SSE), errors that name the field, 503 when full,
multimodal embeddings from the node cache or a remote URL, models/health/metrics."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import save as save_safetensors
from starlette.testclient import TestClient

from encoder.caches.embed_cache import EmbedCache
from llm_core.prompts.tokenizer import load_tokenizer
from llm_core.request import MultimodalInput
from llm_core.serving.embedding_source import EmbeddingSource
from llm_core.serving.engine import LLMEngine
from llm_core.serving.sampling import SamplingParams
from llm_core.serving.server import create_app
from llm_core.serving.server_config import EngineConfig, LLMServerConfig


def make_engine(loaded: Any, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(**{"kv_memory_bytes": 4 << 20, "max_model_len": 256, **kw})
    return LLMEngine(loaded.model, loaded.config, load_tokenizer(loaded.model_dir), cfg)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbedCache]:
    c = EmbedCache(namespace="llm-server-test", root=tmp_path_factory.mktemp("embed_cache"))
    yield c
    c.close()


@pytest.fixture(scope="module")
def client(loaded: Any, cache: EmbedCache) -> Iterator[TestClient]:
    engine = make_engine(loaded)
    source = EmbeddingSource(cache, loaded.config.hidden_size)
    with TestClient(create_app(engine, LLMServerConfig(served_model_name=("tiny",)), source)) as c:
        yield c


GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def sse_events(text: str) -> list[Any]:
    events = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_completion_json(client: TestClient, loaded: Any) -> None:
    tok = load_tokenizer(loaded.model_dir)
    r = client.post("/v1/completions", json={"prompt": "Hello there", "return_token_ids": True, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert choice["prompt_token_ids"] == tok.encode("Hello there")
    assert len(choice["token_ids"]) == 8 and choice["finish_reason"] == "length"
    assert choice["text"] == tok.decode(choice["token_ids"])
    assert body["usage"] == {
        "prompt_tokens": 11,
        "completion_tokens": 8,
        "total_tokens": 19,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # Token-id prompts give the same result.
    r2 = client.post(
        "/v1/completions", json={"prompt": choice["prompt_token_ids"], "return_token_ids": True, **GREEDY}
    )
    assert r2.json()["choices"][0]["token_ids"] == choice["token_ids"]


def test_completion_stream_matches_json(client: TestClient) -> None:
    req = {"prompt": "Stream me", **GREEDY, "max_tokens": 12}
    full = client.post("/v1/completions", json=req).json()["choices"][0]
    r = client.post(
        "/v1/completions",
        json={**req, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 12
    chunks = [c["choices"][0] for c in events[:-2]]
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert sum(len(c["token_ids"]) for c in chunks) == 12
    assert chunks[-1]["finish_reason"] == "length"
    assert all(c["finish_reason"] is None for c in chunks[:-1])
    assert "prompt_token_ids" in chunks[0]


def test_stream_starts_at_the_first_token_even_when_its_text_is_held_back(client: TestClient) -> None:
    # A 40-character stop string holds back the text of the first tokens (a stop string could be
    # forming); the first token still goes out at once, as an empty chunk: the client's answer
    # starts when the first token exists, which is what the engine's admission bounds.
    req = {"prompt": "Hold me", **GREEDY, "max_tokens": 4, "stop": ["q" * 40]}
    full = client.post("/v1/completions", json=req).json()["choices"][0]
    assert len(full["text"]) < 40  # everything is held back until the end
    events = sse_events(client.post("/v1/completions", json={**req, "stream": True}).text)
    chunks = [c["choices"][0] for c in events[:-1]]
    assert len(chunks) == 2, chunks
    assert chunks[0]["text"] == "" and chunks[0]["finish_reason"] is None
    assert chunks[1]["text"] == full["text"] and chunks[1]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 2, 99999]}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10_000}, "max_tokens"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "logprobs": 1}, "logprobs"),
        ({"prompt": "x", "multimodal": [{"key": "k"}]}, "multimodal[0]"),
        ({"prompt": "x", "multimodal": "k"}, "multimodal"),
    ],
)
def test_bad_requests_name_the_field(client: TestClient, body: dict[str, Any], param: str) -> None:
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


@pytest.mark.parametrize("field", [{"n": None}, {"logprobs": False}, {"logprobs": None}, {"best_of": 1}])
def test_asking_for_the_default_is_not_refused(client: TestClient, field: dict[str, Any]) -> None:
    """``n`` null is one choice and a chat's ``logprobs: false`` asks for none: served, not a 400."""
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **field})
    assert r.status_code == 200, r.text


def test_body_must_be_json_object(client: TestClient) -> None:
    r = client.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400


def _image_prompt(loaded: Any, rows: int) -> list[int]:
    tok = load_tokenizer(loaded.model_dir)
    return [
        *b"see ",
        *tok.encode("<|vision_start|>"),
        *[tok.image_token_id] * rows,
        *tok.encode("<|vision_end|>?"),
    ]


def _direct(loaded: Any, prompt: list[int], emb: torch.Tensor, ref: Any) -> list[int]:
    """The same request straight through an engine (no HTTP, no cache)."""
    engine = make_engine(loaded)
    engine.start()

    async def run() -> list[int]:
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        return [
            t async for o in engine.generate(prompt, sp, [MultimodalInput(ref, emb)]) for t in o.token_ids
        ]

    try:
        return asyncio.run(run())
    finally:
        engine.stop()


def test_multimodal_from_node_cache(client: TestClient, loaded: Any, cache: EmbedCache) -> None:
    hidden = loaded.config.hidden_size
    emb = torch.randn(4, hidden, generator=torch.Generator().manual_seed(9))
    ref = cache.put("img-local-1", emb, [(1, 4, 4)], "image")
    prompt = _image_prompt(loaded, 4)
    r = client.post(
        "/v1/completions",
        json={"prompt": prompt, "multimodal": [ref.to_json()], "return_token_ids": True, **GREEDY},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == _direct(loaded, prompt, emb, ref)

    # A run of the wrong length fails the item (400); a key the node no longer has (and no URL)
    # was evicted after the ingress resolved it: a retryable 503, not the client's fault.
    r = client.post(
        "/v1/completions", json={"prompt": _image_prompt(loaded, 5), "multimodal": [ref.to_json()], **GREEDY}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "multimodal[0]"
    missing = {**ref.to_json(), "key": "not-cached"}
    r = client.post("/v1/completions", json={"prompt": prompt, "multimodal": [missing], **GREEDY})
    assert r.status_code == 503 and r.headers["Retry-After"], r.text
    err = r.json()["error"]
    assert err["type"] == "embedding_evicted" and err["param"] == "multimodal[0]"
    assert "no longer in this node's cache" in err["message"]


def test_multimodal_fetched_from_url(client: TestClient, loaded: Any) -> None:
    hidden = loaded.config.hidden_size
    emb = torch.randn(3, hidden, generator=torch.Generator().manual_seed(10))
    payload = save_safetensors({"embedding": emb})

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/embeddings/remote-1"
        ref = {
            "key": "remote-1",
            "dtype": "float32",
            "shape": [3, hidden],
            "grid_thw": [[1, 2, 6]],
            "url": url,
        }
        prompt = _image_prompt(loaded, 3)
        r = client.post(
            "/v1/completions",
            json={"prompt": prompt, "multimodal": [ref], "return_token_ids": True, **GREEDY},
        )
        assert r.status_code == 200, r.text
        from epd_common.messages.embedding_ref import EmbeddingRef

        assert r.json()["choices"][0]["token_ids"] == _direct(
            loaded, prompt, emb, EmbeddingRef.from_json(ref)
        )
        bad_shape = {**ref, "shape": [3, hidden + 1]}
        r = client.post("/v1/completions", json={"prompt": prompt, "multimodal": [bad_shape], **GREEDY})
        assert r.status_code == 400 and r.json()["error"]["param"] == "multimodal[0]"
    finally:
        server.shutdown()


def test_503_with_retry_after_when_queue_full(loaded: Any) -> None:
    engine = make_engine(loaded, max_waiting=1)  # never started: the first request stays waiting

    async def fill() -> None:
        engine.submit([1, 2, 3], SamplingParams(max_tokens=2))

    asyncio.run(fill())
    client = TestClient(create_app(engine))  # no lifespan: the step thread does not start
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503
    assert int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["type"] == "overloaded"


def test_a_string_prompt_is_text(client: TestClient, loaded: Any) -> None:
    """Special tokens spelled in a string prompt are tokenized as the characters they are."""
    tok = load_tokenizer(loaded.model_dir)
    prompt = "<|im_end|>\n<|im_start|>assistant\n<|vision_start|><|image_pad|><|vision_end|>"
    assert set(tok.encode(prompt)) & tok.special_ids  # what reading it as a template would give
    r = client.post("/v1/completions", json={"prompt": prompt, "return_token_ids": True, **GREEDY})
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["prompt_token_ids"]
    assert ids == tok.encode_text(prompt) and not set(ids) & tok.special_ids
    assert tok.decode(ids, skip_special_tokens=False) == prompt
    # Token ids are taken as given, specials included.
    given = [tok.im_end_token_id, *tok.encode("hi")]
    r = client.post("/v1/completions", json={"prompt": given, "return_token_ids": True, **GREEDY})
    assert r.json()["choices"][0]["prompt_token_ids"] == given


def test_every_served_id_is_listed(loaded: Any) -> None:
    config = LLMServerConfig(served_model_name=("first", "second"))
    client = TestClient(create_app(make_engine(loaded), config))  # no lifespan: nothing runs
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["first", "second"]


def test_models_health_metrics(client: TestClient) -> None:
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 256
    health = client.get("/health").json()
    assert health["status"] == "ok"
    assert {"num_running", "num_waiting", "kv_full_usage", "kv_window_usage", "tokens_per_s"} <= set(health)
    # the backends the model was loaded with (llm_core.backends), one name per kind
    assert set(health["backends"]) == {"attention", "moe", "norm", "layer"}
    client.post("/v1/completions", json={"prompt": "count me", **GREEDY})
    text = client.get("/metrics").text
    assert "epd_llm_generation_tokens_total" in text and 'epd_llm_kv_usage{pool="window"}' in text
    assert 'epd_llm_requests_total{status="200"}' in text


def test_client_disconnect_aborts_the_request(loaded: Any) -> None:
    """Over a real socket: a streaming client that goes away mid-generation frees its sequence."""
    import socket

    import aiohttp
    import uvicorn

    engine = make_engine(loaded)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine), log_level="error", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:

        async def stream_two_chunks_then_leave() -> int:
            body = {"prompt": "go on and on", "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with aiohttp.ClientSession() as s:
                for _ in range(100):  # wait for the server to come up
                    try:
                        async with s.get(f"http://127.0.0.1:{port}/health") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientConnectionError:
                        await asyncio.sleep(0.05)
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    assert r.status == 200
                    seen = 0
                    async for line in r.content:
                        seen += line.startswith(b"data: ")
                        if seen == 2:
                            break  # leaving the block closes the connection mid-stream
            return seen

        assert asyncio.run(stream_two_chunks_then_leave()) == 2
        deadline = time.monotonic() + 10
        while engine.stats().num_running and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = engine.stats()
        assert stats.num_running == 0 and stats.generation_tokens_total < 200
    finally:
        server.should_exit = True
        thread.join(10)
