"""The engine pool over real engine servers on loopback: an engine that refuses a chat for load
passes it to another live engine; when every engine refuses, the 503 carries the shortest wait."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from typing import Any, cast

import aiohttp
import pytest
import uvicorn
from prometheus_client import CollectorRegistry

from epd.engine_body import EngineBody
from epd.engine_client import EngineClient, engine_unavailable
from epd.engine_pool import EnginePool
from epd.llm_routing.policy import RouterConfig
from epd_common.errors import APIError
from epd_common.messages.completion_request import completion_request
from llm_core.models.checkpoint import LoadedLLM, load_llm
from llm_core.prompts.tokenizer import Tokenizer, load_tokenizer
from llm_core.serving.engine import LLMEngine
from llm_core.serving.sampling import SamplingParams
from llm_core.serving.server import create_app
from llm_core.serving.server_config import EngineConfig
from tests.epd.conftest import free_port
from tests.llm_core.conftest import build_tiny_mimo
from tests.uvicorn_thread import serve_in_thread


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedLLM:
    return load_llm(build_tiny_mimo(tmp_path_factory.mktemp("pool_mimo")))


def make_engine(loaded: LoadedLLM, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(**{"kv_memory_bytes": 4 << 20, "max_model_len": 256, **kw})
    return LLMEngine(loaded.model, loaded.config, load_tokenizer(loaded.model_dir), cfg)


def busy_engine(loaded: LoadedLLM, seed_tokens_per_s: float) -> LLMEngine:
    """An engine that never steps, holding one request of 103 tokens of work: at the seeded rate
    anything more would wait past a 1 s deadline."""
    engine = make_engine(loaded, admission_seed_tokens_per_s=seed_tokens_per_s)

    async def fill() -> None:
        engine.submit([1, 2, 3], SamplingParams(max_tokens=100))

    asyncio.run(fill())
    return engine


@contextmanager
def served(engine: LLMEngine, start: bool) -> Iterator[str]:
    """``engine``'s server on a loopback port (``start``: with its step thread) until the block ends."""
    port = free_port()
    config = uvicorn.Config(
        create_app(engine),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="on" if start else "off",
    )
    with serve_in_thread(config, "engine server"):
        yield f"http://127.0.0.1:{port}"


BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


async def _complete(urls: list[str], loaded: LoadedLLM) -> tuple[Any, EnginePool]:
    async with aiohttp.ClientSession() as session:
        pool = EnginePool(
            session, urls, load_tokenizer(loaded.model_dir), RouterConfig(policy="round_robin"),
            CollectorRegistry(),
        )  # fmt: skip
        await pool.poll()
        assert all(pool.up.values()), pool.up
        try:
            out: Any = await pool.complete(
                dict(BODY), pool.cache_keys(BODY["prompt"]), time.monotonic() + 1.0
            )
        except APIError as exc:
            out = exc
        return out, pool


def test_a_refusing_engine_passes_the_request_to_the_next(loaded: LoadedLLM) -> None:
    with (
        served(busy_engine(loaded, 10.0), start=False) as busy,
        served(make_engine(loaded), start=True) as free,
    ):
        out, pool = asyncio.run(_complete([busy, free], loaded))  # round robin: the busy one first
    assert not isinstance(out, APIError), out
    assert out["choices"][0]["finish_reason"] == "length"  # all 4 tokens, from the free engine
    assert pool.metrics.refused._value.get() == 1  # the busy engine refused once


def test_every_engine_refusing_answers_with_the_shortest_wait(loaded: LoadedLLM) -> None:
    slow, slower = busy_engine(loaded, 10.0), busy_engine(loaded, 5.0)
    with served(slow, start=False) as a, served(slower, start=False) as b:
        out, pool = asyncio.run(_complete([a, b], loaded))
    assert isinstance(out, APIError), out
    assert out.status == 503 and out.type == "overloaded"
    # the first token after 103 tokens waiting ahead and its 4 prompt tokens: 10.7 s at 10 tokens/s,
    # 21.4 s at 5; Retry-After goes in whole seconds, rounded up
    assert out.retry_after_s == 11.0
    assert "all 2 LLM engines refused for load" in out.message
    assert pool.metrics.refused._value.get() == 2


class _FakeEngine(EngineClient):
    """An engine client that answers from memory: ``down`` raises what an unreachable engine does."""

    def __init__(self, session: aiohttp.ClientSession, url: str, timeout_s: float) -> None:
        super().__init__(session, url, timeout_s)
        self.down = False
        self.calls = 0

    async def complete(
        self, body: EngineBody, request_id: str | None = None, deadline_s: float | None = None,
        path: str = "/v1/completions",
    ) -> dict[str, Any]:  # fmt: skip
        self.calls += 1
        if self.down:
            raise engine_unavailable(f"{self.base_url}: connection refused")
        return {"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}], "usage": {}}

    async def stream(
        self, body: EngineBody, request_id: str | None = None, deadline_s: float | None = None,
        path: str = "/v1/completions", relay: bool = False,
    ) -> AsyncGenerator[dict[str, Any], None]:  # fmt: skip
        """Three chunks; ``down`` before the first; ``fail_after`` chunks then an unreachable error."""
        self.calls += 1
        for i in range(3):
            if self.down or (self.fail_after is not None and i == self.fail_after):
                raise engine_unavailable(f"{self.base_url}: connection reset")
            yield {"choices": [{"index": 0, "text": f"{self.base_url} {i}"}]}

    fail_after: int | None = None


def test_an_unreachable_prefill_engine_is_not_failed_over_to_a_decode_engine() -> None:
    """With split roles the prefill router's failover looks at the prefill engines only: a live
    decode engine is no candidate for a prefill, so no re-route is counted, and the decode engine
    computes the prompt itself."""
    urls = ["http://prefill", "http://decode"]

    async def main() -> EnginePool:
        async with aiohttp.ClientSession() as session:
            pool = EnginePool(
                session, urls, cast(Tokenizer, None), RouterConfig(), CollectorRegistry(),
                roles=("prefill", "decode"), make_client=_FakeEngine,
            )  # fmt: skip
            for u in urls:
                pool.mark(u, True)
            prefill = pool.clients[urls[0]]
            assert isinstance(prefill, _FakeEngine)
            prefill.down = True
            out = await pool.complete(completion_request(BODY), [5, 6, 7, 8])  # split: the Struct
            assert out["choices"][0]["text"] == "ok"
            return pool

    pool = asyncio.run(main())
    assert pool.metrics.failovers._value.get() == 0
    assert pool.metrics.kv_fallbacks.labels(reason="prefill_unavailable")._value.get() == 1
    assert pool.up == {urls[0]: False, urls[1]: True}


def _fake_pool(session: aiohttp.ClientSession, n: int) -> tuple[EnginePool, list[_FakeEngine]]:
    urls = [f"http://e{i}" for i in range(n)]
    pool = EnginePool(
        session, urls, cast(Tokenizer, None), RouterConfig(policy="round_robin"), CollectorRegistry(),
        make_client=_FakeEngine,
    )  # fmt: skip
    for u in urls:
        pool.mark(u, True)
    return pool, [cast(_FakeEngine, pool.clients[u]) for u in urls]


def test_a_stream_fails_over_before_its_first_chunk_and_never_after() -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            pool, (e0, e1) = _fake_pool(session, 2)
            e0.down = True  # round robin: e0 first
            texts = [c["choices"][0]["text"] async for c in pool.stream(dict(BODY), [5, 6, 7, 8])]
            assert texts == ["http://e1 0", "http://e1 1", "http://e1 2"]
            assert pool.up == {"http://e0": False, "http://e1": True}
            assert pool.metrics.failovers._value.get() == 1
            for e in (e0, e1):  # mid-answer: the client has a chunk already, no other engine takes over
                e.fail_after = 1
            pool.mark("http://e0", True)
            e0.down = False
            got: list[str] = []
            with pytest.raises(APIError) as info:
                async for c in pool.stream(dict(BODY), [5, 6, 7, 8]):
                    got.append(c["choices"][0]["text"])
            assert info.value.type == "engine_unavailable" and len(got) == 1
            assert e0.calls + e1.calls == 3  # no second engine for the broken stream
            stats = pool.router.stats()
            assert all(e.load.inflight == 0 for e in stats.engines)  # every dispatch finished

    asyncio.run(main())


def test_every_engine_unreachable_or_down_is_a_503_engine_unavailable() -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            pool, engines = _fake_pool(session, 2)
            for e in engines:
                e.down = True
            with pytest.raises(APIError) as info:
                await pool.complete(dict(BODY), [5, 6, 7, 8])
            assert (info.value.status, info.value.type) == (503, "engine_unavailable")
            assert "connection refused" in info.value.message  # the last engine's own error
            assert not pool.any_up and pool.metrics.failovers._value.get() == 1
            with pytest.raises(APIError) as info:  # none up at all: not sent anywhere
                await pool.complete(dict(BODY), [5, 6, 7, 8])
            assert (info.value.status, info.value.type, info.value.retry_after_s) == (
                503, "engine_unavailable", 2.0,
            )  # fmt: skip
            assert sum(e.calls for e in engines) == 2

    asyncio.run(main())


def test_expected_wait_is_the_least_refusal_counted_down() -> None:
    """What the ingress refuses a chat by before any work: every live engine's last refusal, counted
    down; an engine that has not refused lately (or is down) makes it 0 / is left out."""

    async def main() -> list[float]:
        async with aiohttp.ClientSession() as session:
            pool, _ = _fake_pool(session, 2)
            seen = [pool.expected_wait_s()]
            pool.refusals.note("http://e0", 30.0)
            seen.append(pool.expected_wait_s())  # e1 has not refused: it would take a chat now
            pool.refusals.note("http://e1", 20.0)
            seen.append(pool.expected_wait_s())
            pool.mark("http://e1", False)  # a down engine is no way in
            seen.append(pool.expected_wait_s())
            return seen

    none, one, both, down = asyncio.run(main())
    assert none == 0.0 and one == 0.0
    assert 19.0 < both <= 20.0 and 29.0 < down <= 30.0
