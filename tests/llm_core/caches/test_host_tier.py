"""The host tier: pages the prefix cache evicts come back by copy, and a returning session's greedy
ids equal the ids of the same session recomputed (and of an engine whose pool never evicted), with
images in the history; what is kept per page is full KV plus the SWA window at node ends."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from llm_core.caches.host_restore import FetchCostModel
from llm_core.prompts.tokenizer import load_tokenizer
from llm_core.request import MultimodalInput
from llm_core.serving.engine import LLMEngine
from llm_core.serving.sampling import SamplingParams
from llm_core.serving.server_config import EngineConfig
from tests.llm_core.serving.test_engine import VISION_END, VISION_START, media_ref, prompt_of


def make_engine(loaded: Any, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(**{"kv_memory_bytes": 4 << 20, "max_model_len": 512, "page_size": 4, **kw})
    engine = LLMEngine(loaded.model, loaded.config, load_tokenizer(loaded.model_dir), cfg)
    engine.start()
    return engine


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def ids_of(engine: LLMEngine, prompt: list[int], n: int, mm: Any = ()) -> tuple[list[int], int]:
    stream = engine.submit(prompt, greedy(n), mm)
    ids, cached = [], 0
    async for out in stream:
        ids.extend(out.token_ids)
        cached = out.num_cached_tokens
    return ids, cached


def session(engine: LLMEngine, turns: list[list[int]], mm: Any, fillers: list[list[int]]) -> list[list[int]]:
    """Each turn re-sends the history plus the turn's answer; between turns, other requests push
    the history out of the device pool."""

    async def run() -> list[list[int]]:
        history: list[int] = []
        answers = []
        for t, user in enumerate(turns):
            prompt = history + user
            ids, _ = await ids_of(engine, prompt, 6, mm)
            answers.append(ids)
            history = prompt + ids
            if t + 1 < len(turns):
                for f in fillers:
                    await ids_of(engine, f, 2)
        return answers

    return asyncio.run(run())


def history_turns(loaded: Any) -> tuple[list[list[int]], list[MultimodalInput]]:
    tok = load_tokenizer(loaded.model_dir)
    hidden = loaded.config.hidden_size
    img = torch.randn(6, hidden, generator=torch.Generator().manual_seed(9)) * 0.5
    first = prompt_of(40, 1) + tok.encode(VISION_START) + [tok.image_token_id] * 6 + tok.encode(VISION_END)
    first += prompt_of(30, 2)
    return [first, prompt_of(20, 3), prompt_of(20, 4)], [MultimodalInput(media_ref("img", 6, hidden), img)]


def test_a_returning_session_restored_from_the_host_tier_gives_the_recomputed_ids(loaded: Any) -> None:
    turns, mm = history_turns(loaded)
    fillers = [prompt_of(90, 100 + i) for i in range(4)]
    small = {"kv_memory_bytes": 288 << 10}  # the device pool holds about one history, not the fillers too
    plain = make_engine(loaded)  # a pool that never evicts
    recompute = make_engine(loaded, **small)
    tiered = make_engine(loaded, **small, host_kv_bytes=16 << 20)
    try:
        want = session(plain, turns, mm, fillers)
        without = session(recompute, turns, mm, fillers)
        got = session(tiered, turns, mm, fillers)
        host = tiered.scheduler.kv.host_tier
        assert host is not None
        restored, spilled = host.restored_tokens, host.spilled_pages
        tiered.scheduler.kv.check_integrity(tiered.scheduler.running)
    finally:
        for e in (plain, recompute, tiered):
            e.stop()
    assert spilled > 0 and restored > 0, (spilled, restored)
    assert got == without == want


def test_spilled_pages_keep_full_kv_and_only_the_window_of_swa(loaded: Any) -> None:
    engine = make_engine(loaded, kv_memory_bytes=288 << 10, host_kv_bytes=16 << 20)
    try:
        asyncio.run(ids_of(engine, prompt_of(120, 5), 40))
        for i in range(4):
            asyncio.run(ids_of(engine, prompt_of(90, 200 + i), 2))
        host = engine.scheduler.kv.host_tier
        assert host is not None and len(host) > 0
        pages = list(host._pages.values())
    finally:
        engine.stop()
    with_window = sum(all(p.live) for p in pages)
    assert 0 < with_window < len(pages)  # the windows at node ends, not every page
    for p in pages:
        assert all(layer is not None for i, layer in enumerate(p.layers) if loaded.config.is_full_layer(i))


def test_the_cost_model_prefers_recompute_when_the_copy_is_slower() -> None:
    cost = FetchCostModel(copy_bytes_per_s=1e9, prefill_tokens_per_s=1e4)
    assert cost.fetch_is_faster(10 << 20, 1000)  # 10 ms copy vs 100 ms prefill
    for _ in range(40):
        cost.observe_copy(1 << 20, 1.0)  # a slow tier: 1 MiB/s measured
    assert not cost.fetch_is_faster(10 << 20, 1000)
