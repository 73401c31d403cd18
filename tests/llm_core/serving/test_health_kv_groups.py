"""The engine's /health lists its KV cache groups: one for a full-attention Qwen2.5-VL
checkpoint, a full-attention and a sliding-window group for MiMo; each with its spec, pages and
bytes, drawn from one shared block pool (``kv_pool``) that fits the budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.testclient import TestClient

from llm_core.models.checkpoint import load_llm
from llm_core.prompts.tokenizer import load_tokenizer
from llm_core.serving.engine import LLMEngine
from llm_core.serving.server import create_app
from llm_core.serving.server_config import EngineConfig
from tests.llm_core.serving.test_speculative import random_heads

BUDGET = 4 << 20


def _health(model_dir: Path) -> dict[str, Any]:
    loaded = load_llm(model_dir)
    cfg = EngineConfig(kv_memory_bytes=BUDGET, max_model_len=256)
    engine = LLMEngine(loaded.model, loaded.config, load_tokenizer(model_dir), cfg)
    client = TestClient(create_app(engine))  # no lifespan: nothing runs
    health: dict[str, Any] = client.get("/health").json()
    _check_bytes(health["kv_groups"], health["kv_pool"])
    return health


def _health_groups(model_dir: Path) -> list[dict[str, object]]:
    groups: list[dict[str, object]] = _health(model_dir)["kv_groups"]
    return groups


def _check_bytes(groups: list[dict[str, Any]], pool: dict[str, Any]) -> None:
    """Every group draws from one block pool that fits the budget: a page takes whole blocks, and
    a group alone could take the whole pool."""
    assert pool["shared"] and pool["bytes"] == pool["num_blocks"] * pool["block_bytes"] <= BUDGET
    assert BUDGET - pool["block_bytes"] < pool["bytes"]
    for g in groups:
        assert isinstance(g["num_pages"], int) and g["num_pages"] > 0
        assert g["page_bytes"] == g["blocks_per_page"] * pool["block_bytes"]
        assert g["num_pages"] == pool["num_blocks"] // g["blocks_per_page"]
        assert g["bytes"] == g["page_bytes"] * g["num_pages"] <= pool["bytes"]


def test_qwen2_5_vl_has_one_full_attention_group(qwen_dir: Path) -> None:
    groups = _health_groups(qwen_dir)
    assert [(g["group"], g["kind"], g["sliding_window"]) for g in groups] == [(0, "full_attention", None)]


def test_mimo_has_a_full_and_a_sliding_window_group(tiny_mimo_dir: Path) -> None:
    groups = _health_groups(tiny_mimo_dir)
    config = load_llm(tiny_mimo_dir).config
    assert [(g["group"], g["kind"]) for g in groups] == [(0, "full_attention"), (1, "sliding_window")]
    assert groups[1]["sliding_window"] == config.sliding_window
    assert [g["num_layers"] for g in groups] == [config.num_full_layers, config.num_window_layers]


def test_mtp_heads_join_the_sliding_window_group(tiny_mimo_dir: Path) -> None:
    loaded = load_llm(tiny_mimo_dir)
    cfg = EngineConfig(kv_memory_bytes=BUDGET, max_model_len=256, page_size=4, speculative_steps=2)
    engine = LLMEngine(
        loaded.model, loaded.config, load_tokenizer(tiny_mimo_dir), cfg, mtp=random_heads(loaded.config)
    )
    health = TestClient(create_app(engine)).get("/health").json()
    groups = health["kv_groups"]
    _check_bytes(groups, health["kv_pool"])
    assert [(g["kind"], g["num_mtp_layers"]) for g in groups] == [
        ("full_attention", 0),
        ("sliding_window", 2),
    ]
    assert groups[1]["num_layers"] == loaded.config.num_window_layers + 2
