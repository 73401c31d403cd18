"""Prefill on engine A, decode on engine B (the prompt's KV moved through a real transport) gives
the greedy ids of one engine doing both: at every prompt length around the page and window edges,
with media, when A had a prefix hit, when B preempts; the bytes moved are the layer plan's; a
transfer that fails is recomputed on B with the same ids."""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

import pytest
import torch

from epd_common.messages.completion_response import KVTransferReport
from llm_core.kv_transfer.transport import KVTransferError
from llm_core.prompts.tokenizer import load_tokenizer
from llm_core.request import MultimodalInput
from llm_core.serving.engine import LLMEngine
from llm_core.serving.kv_handoff import KVHandoff
from llm_core.serving.sampling import SamplingParams
from llm_core.serving.server_config import EngineConfig
from tests.llm_core.serving.test_engine import VISION_END, VISION_START, media_ref, prompt_of

PAGE = 4


def make_engine(
    loaded: Any, namespace: str, transport: str = "shm", ttl_s: float = 60.0, **kw: Any
) -> LLMEngine:
    cfg = EngineConfig(**{"kv_memory_bytes": 4 << 20, "max_model_len": 512, "page_size": PAGE, **kw})
    engine = LLMEngine(loaded.model, loaded.config, load_tokenizer(loaded.model_dir), cfg)
    engine.handoff = KVHandoff(transport, namespace, engine.kv, ttl_s=ttl_s, arena_bytes=16 << 20)
    engine.start()
    return engine


@pytest.fixture
def namespace() -> str:
    return f"handoff-{uuid.uuid4().hex[:8]}"


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def run(
    engine: LLMEngine, prompt: list[int], sp: SamplingParams, mm: Any = (), **kw: Any
) -> tuple[str, list[int]]:
    stream = engine.submit(prompt, sp, mm, **kw)
    ids = [t async for out in stream for t in out.token_ids]
    return stream.request_id, ids


async def prefill_then_decode(
    a: LLMEngine, b: LLMEngine, prompt: list[int], n: int, mm: Any = (), corrupt: bool = False
) -> tuple[list[int], KVTransferReport, KVTransferReport]:
    rid, first = await run(a, prompt, greedy(1), mm, kv_export=True)
    export = a.pop_export(rid)
    assert export is not None and export.handle is not None, export
    handle = dict(export.handle)
    if corrupt:
        handle["xxh3"] = f"{(int(handle['xxh3'], 16) ^ 1):016x}"
    assert b.handoff is not None
    got = await b.handoff.fetch(handle, first[0], prompt)
    _, ids = await run(b, prompt, greedy(n), mm, kv_import=got.kv_import)
    assert ids[:1] == first
    return ids, export, got.info


def plan_bytes(cfg: Any, num_tokens: int) -> int:
    """The layer plan from its definition: full layers move every page of the prompt, SWA layers
    the pages from the window of the last page boundary on (fp32 K and V)."""
    pages = math.ceil(num_tokens / PAGE)
    boundary = num_tokens // PAGE * PAGE
    swa_pages = pages - max(0, boundary - cfg.sliding_window + 1) // PAGE
    total = 0
    for i in range(cfg.num_hidden_layers):
        swa = not cfg.is_full_layer(i)
        heads = cfg.swa_num_key_value_heads if swa else cfg.num_key_value_heads
        total += (swa_pages if swa else pages) * PAGE * heads * (cfg.head_dim + cfg.v_head_dim) * 4
    return total


@pytest.mark.parametrize("length", [1, 3, 4, 5, 8, 9, 12, 13, 40, 97])
def test_split_equals_one_engine_and_moves_the_plan(loaded: Any, namespace: str, length: int) -> None:
    prompt = prompt_of(length, length)
    one = make_engine(loaded, namespace)
    a, b = make_engine(loaded, namespace), make_engine(loaded, namespace)
    try:
        _, expected = asyncio.run(run(one, prompt, greedy(12)))
        ids, export, info = asyncio.run(prefill_then_decode(a, b, prompt, 12))
    finally:
        for e in (one, a, b):
            e.stop()
    assert ids == expected
    assert info.imported is True
    assert export.kv_bytes == info.kv_bytes == plan_bytes(loaded.config, length)
    assert export.bytes == info.bytes > export.kv_bytes  # plus the header


def test_bytes_beat_moving_every_layer_on_long_prompts(loaded: Any, namespace: str) -> None:
    cfg = loaded.config
    assert any(not cfg.is_full_layer(i) for i in range(cfg.num_hidden_layers))
    heads = [
        cfg.num_key_value_heads if cfg.is_full_layer(i) else cfg.swa_num_key_value_heads
        for i in range(cfg.num_hidden_layers)
    ]
    everything = sum(math.ceil(200 / PAGE) * PAGE * 4 * h * (cfg.head_dim + cfg.v_head_dim) for h in heads)
    assert plan_bytes(cfg, 200) < everything / 2


def test_split_with_media_and_a_prefix_hit_on_the_prefill_engine(loaded: Any, namespace: str) -> None:
    tok = load_tokenizer(loaded.model_dir)
    hidden = loaded.config.hidden_size
    img = torch.randn(6, hidden, generator=torch.Generator().manual_seed(5)) * 0.5
    prompt = prompt_of(11, 1) + tok.encode(VISION_START) + [tok.image_token_id] * 6
    prompt += tok.encode(VISION_END) + prompt_of(30, 2)
    mm = [MultimodalInput(media_ref("img", 6, hidden), img)]
    one = make_engine(loaded, namespace)
    a, b = make_engine(loaded, namespace), make_engine(loaded, namespace)
    try:
        _, expected = asyncio.run(run(one, prompt, greedy(10), mm))
        for _ in range(3):  # the repeats hit A's prefix cache (the first one heals its window)
            ids, _, info = asyncio.run(prefill_then_decode(a, b, prompt, 10, mm))
            assert ids == expected and info.imported is True
        assert a.stats().cached_prompt_tokens_total > 0
    finally:
        for e in (one, a, b):
            e.stop()


def test_split_with_preemption_on_the_decode_engine(loaded: Any, namespace: str) -> None:
    prompts = [prompt_of(60, 100 + i) for i in range(6)]
    one = make_engine(loaded, namespace)
    a = make_engine(loaded, namespace)
    b = make_engine(loaded, namespace, kv_memory_bytes=256 << 10, max_num_batched_tokens=32)  # nearly full

    async def all_split() -> list[list[int]]:
        return [
            ids for ids, _, _ in await asyncio.gather(*(prefill_then_decode(a, b, p, 40) for p in prompts))
        ]

    try:
        expected = [asyncio.run(run(one, p, greedy(40)))[1] for p in prompts]
        got = asyncio.run(all_split())
        preemptions = b.scheduler.num_preemptions
        b.scheduler.kv.check_integrity(b.scheduler.running)
    finally:
        for e in (one, a, b):
            e.stop()
    assert preemptions > 0, "the decode engine's pools were not tight enough to preempt"
    assert got == expected


def test_a_failed_transfer_is_recomputed_with_the_same_ids(loaded: Any, namespace: str) -> None:
    prompt = prompt_of(50, 7)
    one = make_engine(loaded, namespace)
    a, b = make_engine(loaded, namespace), make_engine(loaded, namespace)
    try:
        _, expected = asyncio.run(run(one, prompt, greedy(8)))
        ids, _, info = asyncio.run(prefill_then_decode(a, b, prompt, 8, corrupt=True))
        assert b.handoff is not None and b.handoff.fallbacks == {"checksum": 1}
    finally:
        for e in (one, a, b):
            e.stop()
    assert info == KVTransferReport(imported=False, reason="checksum", seconds=info.seconds)
    assert ids == expected


@pytest.mark.parametrize("length", [13, 97])
def test_split_over_mooncake_equals_one_engine(loaded: Any, namespace: str, length: int) -> None:
    pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda is not installed")
    prompt = prompt_of(length, 3)
    one = make_engine(loaded, namespace)
    a, b = make_engine(loaded, namespace, "mooncake"), make_engine(loaded, namespace, "mooncake")
    try:
        _, expected = asyncio.run(run(one, prompt, greedy(10)))
        ids, export, info = asyncio.run(prefill_then_decode(a, b, prompt, 10))
    finally:
        for e in (one, a, b):
            e.stop()
    assert (export.handle or {})["transport"] == "mooncake" and info.imported is True
    assert info.kv_bytes == plan_bytes(loaded.config, length)
    assert ids == expected


def test_a_receiver_slower_than_the_exports_ttl_recomputes(loaded: Any, namespace: str) -> None:
    prompt = prompt_of(30, 9)
    one = make_engine(loaded, namespace)
    a, b = make_engine(loaded, namespace, ttl_s=0.2), make_engine(loaded, namespace)

    async def slow() -> tuple[list[int], KVTransferReport]:
        rid, first = await run(a, prompt, greedy(1), kv_export=True)
        export = a.pop_export(rid)
        assert export is not None and b.handoff is not None
        await asyncio.sleep(2.5)  # past the ttl and a reaper pass: the exporter dropped it
        got = await b.handoff.fetch(export.handle, first[0], prompt)
        _, ids = await run(b, prompt, greedy(8), kv_import=got.kv_import)
        return ids, got.info

    try:
        _, expected = asyncio.run(run(one, prompt, greedy(8)))
        ids, info = asyncio.run(slow())
    finally:
        for e in (one, a, b):
            e.stop()
    assert info.imported is False and info.reason == "missing", info
    assert ids == expected


def test_a_payload_for_another_prompt_is_refused(loaded: Any, namespace: str) -> None:
    a, b = make_engine(loaded, namespace), make_engine(loaded, namespace)
    try:
        rid, first = asyncio.run(run(a, prompt_of(20, 1), greedy(1), kv_export=True))
        export = a.pop_export(rid)
        assert export is not None and b.handoff is not None
        got = asyncio.run(b.handoff.fetch(export.handle, first[0], prompt_of(21, 1)))
    finally:
        a.stop()
        b.stop()
    assert got.kv_import is None and got.info.reason == "payload"
    with pytest.raises(KVTransferError):
        raise KVTransferError("missing", "the error type is importable for callers")
