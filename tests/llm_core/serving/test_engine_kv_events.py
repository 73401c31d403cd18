"""The engine publishes its prefix cache over ZMQ: a subscriber that applies the events knows
exactly which pages the tree holds; /health names the endpoints, the load and the requests held."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import zmq
from starlette.testclient import TestClient

from epd_common.messages.kv_events import (
    FULL_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)
from epd_common.messages.page_hash import page_hashes
from llm_core.prompts.tokenizer import load_tokenizer
from llm_core.serving.engine import LLMEngine
from llm_core.serving.kv_event_publisher import KVEventPublisher
from llm_core.serving.sampling import SamplingParams
from llm_core.serving.server import create_app
from llm_core.serving.server_config import EngineConfig, LLMServerConfig


def engine_with_events(loaded: Any, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(**{"kv_memory_bytes": 2 << 20, "max_model_len": 256, "page_size": 4, **kw})
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    return LLMEngine(loaded.model, loaded.config, load_tokenizer(loaded.model_dir), cfg, kv_events=pub)


def replay_all(endpoint: str) -> list[tuple[int, KVEventBatch]]:
    """Every kept batch, through the replay socket (no slow-joiner loss)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        out: list[tuple[int, KVEventBatch]] = []
        while True:
            assert sock.poll(5000), "no replay answer"
            _, seq, payload = sock.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            out.append((int.from_bytes(seq, "big"), decode_batch(payload)))
    finally:
        sock.close(0)


def tree_pages(engine: LLMEngine) -> dict[int, bool]:
    radix = engine.scheduler.kv.radix
    assert radix is not None
    out: dict[int, bool] = {}
    stack = [radix.root]
    while stack:
        nd = stack.pop()
        for c in nd.children.values():
            out.update((h, c.pages[1] is not None) for h in c.page_hashes)
            stack.append(c)
    return out


async def run(engine: LLMEngine, prompts: list[list[int]]) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def one(p: list[int]) -> None:
        async for _ in engine.generate(p, greedy):
            pass

    await asyncio.gather(*(one(p) for p in prompts))


def test_events_rebuild_the_tree_and_name_pages_by_content(loaded: Any) -> None:
    engine = engine_with_events(loaded, kv_memory_bytes=320 << 10)  # small: the tree must evict
    engine.start()
    try:
        system = list(range(5, 45))  # a shared 40-token prefix: 10 pages
        prompts = [[*system, 100 + i, 7, 8, 9, 10, 11] for i in range(6)]
        for _ in range(3):  # repeats hit, heal and (with a small pool) evict
            asyncio.run(run(engine, [[50 + (7 * i) % 60 for i in range(90)] for _ in range(2)]))
            asyncio.run(run(engine, prompts))
        time.sleep(0.3)  # the publisher thread sends what is queued
        assert engine.kv_events is not None
        batches = replay_all(engine.kv_events.replay_endpoint or "")
    finally:
        engine.stop()
    seqs = [s for s, _ in batches]
    assert seqs == list(range(len(seqs))) and len(seqs) > 3
    assert batches[0][1].events == (AllBlocksCleared(),)  # a restarted engine starts clean
    pages: dict[int, bool] = {}
    kinds = set()
    for _, batch in batches:
        for e in batch.events:
            kinds.add(f"{type(e).__name__}/{getattr(e, 'group_idx', None)}")
            if isinstance(e, BlockStored):
                for h in e.block_hashes:
                    pages[h] = e.group_idx != FULL_GROUP
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    if e.group_idx == FULL_GROUP:
                        del pages[h]
                    else:
                        pages[h] = False
            else:
                pages.clear()
    assert pages == tree_pages(engine)
    # window KV dropped while the full KV stays (group 1) and pages removed (group 0), as vLLM names them
    assert {"BlockStored/0", "BlockStored/1", "BlockRemoved/1", "BlockRemoved/0"} <= kinds, kinds
    # the shared system prompt's pages are named by its content, as a router computes them
    assert set(page_hashes(system, 4)) <= set(pages)


def test_health_reports_routing_fields_and_request_ids(loaded: Any) -> None:
    engine = engine_with_events(loaded)
    with TestClient(create_app(engine, LLMServerConfig(served_model_name=("tiny",)))) as client:
        body = {"prompt": list(range(5, 40)), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = client.post("/v1/completions", json=body, headers={"X-Request-Id": "route-1"})
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "route-1"
        # the window at the prompt's end was kept while the first run decoded (pin_prompt_end)
        cached = [
            client.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"][
                "cached_tokens"
            ]
            for _ in range(2)
        ]
        assert cached == [32, 32], cached  # 8 whole pages of 35 tokens
        bad = client.post("/v1/completions", json=body, headers={"X-Request-Id": "no spaces"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
        h = client.get("/health").json()
    assert h["page_size"] == 4 and [g["sliding_window"] for g in h["kv_groups"]] == [
        None,
        loaded.config.sliding_window,
    ]
    assert h["kv_events_endpoint"].startswith("tcp://127.0.0.1:")
    assert h["kv_events_replay_endpoint"].startswith("tcp://127.0.0.1:")
    assert len(h["instance_id"]) == 16
    assert h["request_ids"] == [] and h["num_prefill_tokens"] == 0 and h["num_decode_tokens"] == 0
