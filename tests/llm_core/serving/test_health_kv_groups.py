"""The engine's /health lists its KV cache groups: one for a full-attention Qwen2.5-VL
checkpoint, a full-attention and a sliding-window group for MiMo; each with its spec, pages and
bytes, and the bytes add up to what the pools hold."""

from __future__ import annotations

from pathlib import Path

from starlette.testclient import TestClient

from llm_core.models.checkpoint import load_llm
from llm_core.prompts.tokenizer import load_tokenizer
from llm_core.serving.engine import LLMEngine
from llm_core.serving.server import create_app
from llm_core.serving.server_config import EngineConfig
from tests.llm_core.serving.test_speculative import random_heads

BUDGET = 4 << 20


def _health_groups(model_dir: Path) -> list[dict[str, object]]:
    loaded = load_llm(model_dir)
    cfg = EngineConfig(kv_memory_bytes=BUDGET, max_model_len=256)
    engine = LLMEngine(loaded.model, loaded.config, load_tokenizer(model_dir), cfg)
    client = TestClient(create_app(engine))  # no lifespan: nothing runs
    groups: list[dict[str, object]] = client.get("/health").json()["kv_groups"]
    return groups


def _check_bytes(groups: list[dict[str, object]]) -> None:
    for g in groups:
        assert isinstance(g["num_pages"], int) and g["num_pages"] > 0
        assert g["bytes"] == g["page_bytes"] * g["num_pages"]  # type: ignore[operator]
    assert sum(g["bytes"] for g in groups) <= BUDGET  # type: ignore[misc]


def test_qwen2_5_vl_has_one_full_attention_group(qwen_dir: Path) -> None:
    groups = _health_groups(qwen_dir)
    assert [(g["group"], g["kind"], g["sliding_window"]) for g in groups] == [(0, "full_attention", None)]
    _check_bytes(groups)


def test_mimo_has_a_full_and_a_sliding_window_group(tiny_mimo_dir: Path) -> None:
    groups = _health_groups(tiny_mimo_dir)
    config = load_llm(tiny_mimo_dir).config
    assert [(g["group"], g["kind"]) for g in groups] == [(0, "full_attention"), (1, "sliding_window")]
    assert groups[1]["sliding_window"] == config.sliding_window
    assert [g["num_layers"] for g in groups] == [config.num_full_layers, len(config.swa_layer_ids)]
    _check_bytes(groups)


def test_mtp_heads_join_the_sliding_window_group(tiny_mimo_dir: Path) -> None:
    loaded = load_llm(tiny_mimo_dir)
    cfg = EngineConfig(kv_memory_bytes=BUDGET, max_model_len=256, page_size=4, speculative_steps=2)
    engine = LLMEngine(
        loaded.model, loaded.config, load_tokenizer(tiny_mimo_dir), cfg, mtp=random_heads(loaded.config)
    )
    groups = TestClient(create_app(engine)).get("/health").json()["kv_groups"]
    assert [(g["kind"], g["num_mtp_layers"]) for g in groups] == [
        ("full_attention", 0),
        ("sliding_window", 2),
    ]
    assert groups[1]["num_layers"] == len(loaded.config.swa_layer_ids) + 2
    _check_bytes(groups)
