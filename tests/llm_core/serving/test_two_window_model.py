"""A model whose layers use two window sizes (6 and 17) beside one full-attention layer runs through
the engine with no code written for it: its KV groups are one per window, and its greedy ids equal
a plain run (the model's dense forward, no cache) when they come cached, batched, chunked, restored
from the host tier and prefilled on another engine (P/D). The engine's KV events, replayed into the
router's page index, predict the cached tokens the engine reports."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from epd.llm_routing.llm_router import health_windows
from epd.llm_routing.page_index import EnginePageIndex
from epd_common.messages.page_hash import page_hashes
from llm_core.models.checkpoint import LoadedLLM, load_llm
from llm_core.prompts.tokenizer import load_tokenizer
from llm_core.serving.engine import LLMEngine
from llm_core.serving.kv_event_publisher import KVEventPublisher
from llm_core.serving.kv_handoff import KVHandoff
from llm_core.serving.sampling import SamplingParams
from llm_core.serving.server_config import EngineConfig
from tests.llm_core.conftest import build_tiny_mimo
from tests.llm_core.serving.test_engine_kv_events import replay_all

PAGE = 4
WINDOWS = (None, 6, 17, 6)  # layer 0 full attention; layers 1 and 3 window 6, layer 2 window 17
N = 8  # greedy tokens per request


@pytest.fixture(scope="module")
def two_windows(tmp_path_factory: pytest.TempPathFactory) -> LoadedLLM:
    """The tiny checkpoint with 4 layers, its config naming a window per layer (``layer_windows``)."""
    kinds = ["full_attention" if w is None else "sliding_attention" for w in WINDOWS]
    out = build_tiny_mimo(tmp_path_factory.mktemp("two_windows"), num_hidden_layers=4, layer_types=kinds)
    cfg = json.loads((out / "config.json").read_text())
    cfg["layer_windows"] = list(WINDOWS)
    (out / "config.json").write_text(json.dumps(cfg))
    return load_llm(Path(out))


def plain(model: Any, prompt: list[int], n: int = N) -> list[int]:
    """Greedy ids of the model's dense forward over the whole sequence, one token at a time."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model.forward_dense(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def make_engine(loaded: LoadedLLM, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(**{"kv_memory_bytes": 4 << 20, "max_model_len": 512, "page_size": PAGE, **kw})
    return LLMEngine(loaded.model, loaded.config, load_tokenizer(loaded.model_dir), cfg)


async def ids_of(engine: LLMEngine, prompt: list[int], n: int = N, **kw: Any) -> tuple[list[int], int]:
    stream = engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), (), **kw)
    ids, cached = [], 0
    async for out in stream:
        ids.extend(out.token_ids)
        cached = out.num_cached_tokens
    return ids, cached


def prompts() -> list[list[int]]:
    """Prompts sharing a 40-token prefix (10 pages: past both windows), branching at several points."""
    shared = [5 + (11 * i) % 200 for i in range(40)]
    return [shared + [30 + i, 31, 32 + 2 * i, 40 + i] * (1 + i % 3) for i in range(6)]


def test_the_model_has_a_kv_group_per_window(two_windows: LoadedLLM) -> None:
    assert [two_windows.config.window(i) for i in range(4)] == list(WINDOWS)
    engine = make_engine(two_windows)
    groups = [(g.spec.sliding_window, g.layers) for g in engine.kv.groups]
    assert groups == [(None, (0,)), (6, (1, 3)), (17, (2,))]
    assert health_windows({"kv_groups": engine.kv.describe_groups()}) == (None, 6, 17)


def test_greedy_ids_equal_a_plain_run_cached_batched_and_chunked(two_windows: LoadedLLM) -> None:
    want = [plain(two_windows.model, p) for p in prompts()]
    engine = make_engine(two_windows, max_num_batched_tokens=24)  # prompts prefill in chunks
    engine.start()
    try:

        async def all_at_once() -> list[tuple[list[int], int]]:
            return await asyncio.gather(*(ids_of(engine, p) for p in prompts()))

        first = asyncio.run(all_at_once())  # batched and chunked
        again = [asyncio.run(ids_of(engine, p)) for p in prompts()]  # one at a time, from the cache
    finally:
        engine.stop()
    assert [ids for ids, _ in first] == want
    assert [ids for ids, _ in again] == want
    assert all(cached >= 40 for _, cached in again)  # the shared prefix at least, in both windows
    engine.scheduler.kv.check_integrity([])


def test_a_session_restored_from_the_host_tier_gives_the_plain_ids(two_windows: LoadedLLM) -> None:
    engine = make_engine(two_windows, kv_memory_bytes=200 << 10, host_kv_bytes=16 << 20)
    engine.start()
    try:

        async def session() -> list[tuple[list[int], list[int]]]:
            history: list[int] = []
            turns = []
            for turn in range(4):
                prompt = history + [60 + turn, 61, 62 + turn, 63] * 5
                ids, _ = await ids_of(engine, prompt)
                turns.append((prompt, ids))
                history = prompt + ids
                for f in range(3):  # other requests push the history out of the device pool
                    await ids_of(engine, [100 + f + 7 * j % 90 for j in range(120)], 2)
            return turns

        turns = asyncio.run(session())
        host = engine.scheduler.kv.host_tier
        assert host is not None and host.restored_tokens > 0, host.stats()
    finally:
        engine.stop()
    assert [ids for _, ids in turns] == [plain(two_windows.model, prompt) for prompt, _ in turns]


def test_prefill_on_one_engine_and_decode_on_another_gives_the_plain_ids(two_windows: LoadedLLM) -> None:
    namespace = f"two-windows-{uuid.uuid4().hex[:8]}"
    a, b = make_engine(two_windows), make_engine(two_windows)
    for e in (a, b):
        e.handoff = KVHandoff("shm", namespace, e.kv, arena_bytes=16 << 20)
        e.start()
    try:

        async def split(prompt: list[int]) -> list[int]:
            stream = a.submit(
                prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), (), kv_export=True
            )
            first = [t async for out in stream for t in out.token_ids]
            export = a.pop_export(stream.request_id)
            assert export is not None and export.handle is not None, export
            assert b.handoff is not None
            got = await b.handoff.fetch(dict(export.handle), first[0], prompt)
            ids, _ = await ids_of(b, prompt, kv_import=got.kv_import)
            assert ids[:1] == first and got.info.imported, got.info  # the KV came over, not recomputed
            return ids

        for length in (23, 24, 41):  # around page edges and past both windows
            prompt = [7 + (13 * i) % 150 for i in range(length)]
            assert asyncio.run(split(prompt)) == plain(two_windows.model, prompt)
    finally:
        a.stop()
        b.stop()


def settled(endpoint: str) -> list[tuple[int, Any]]:
    """Every batch the engine published, once no new one came for 50 ms (the publisher thread
    sends what the last request's release queued): what a subscriber has when the next request
    is routed."""
    batches = replay_all(endpoint)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.05)
        again = replay_all(endpoint)
        if len(again) == len(batches):
            return again
        batches = again
    return batches


def test_the_router_index_fed_the_engine_events_predicts_its_cached_tokens(two_windows: LoadedLLM) -> None:
    cfg = EngineConfig(kv_memory_bytes=160 << 10, max_model_len=512, page_size=PAGE)
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    engine = LLMEngine(
        two_windows.model, two_windows.config, load_tokenizer(two_windows.model_dir), cfg, kv_events=pub
    )
    index = EnginePageIndex(PAGE, health_windows({"kv_groups": engine.kv.describe_groups()}) or ())
    engine.start()
    applied = 0
    checked = hits = 0
    try:
        probes = [*prompts(), [9 + (5 * i) % 120 for i in range(70)], prompts()[2][:30]]
        for rnd in range(3):
            for p in probes:
                batches = settled(pub.replay_endpoint or "")
                for _, batch in batches[applied:]:
                    index.apply(batch)
                applied = len(batches)
                usable = (len(p) - 1) // PAGE * PAGE
                predicted = index.hit_tokens(page_hashes(p[:usable], PAGE), len(p) - 1)
                _, cached = asyncio.run(ids_of(engine, p, 3 + rnd))
                assert predicted == cached, (rnd, p, predicted, cached)
                checked += 1
                hits += cached > 0
    finally:
        engine.stop()
    assert checked == 24 and hits >= 10  # predictions of real hits, not only of misses
