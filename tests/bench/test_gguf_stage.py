"""Staging a checkpoint for llama.cpp's converter: the release's config spelling from the config our
loader parses, linked weights, a tokenizer the converter's transformers can open."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench.gguf_stage import StageError, release_config, stage_checkpoint
from bench.llm_peer import ensure_checkpoint, small_config
from llm_core.models.checkpoint import DEFAULT_SEED, default_llm_config
from llm_core.models.config import DecoderConfig
from llm_core.tools.default_llm import ensure_default_checkpoint


def _even_rotary() -> DecoderConfig:
    """The default with 20 rotary dims (its own 21 is odd, which llama.cpp cannot rotate)."""
    return dataclasses.replace(
        default_llm_config(), partial_rotary_factor=0.3125, swa_partial_rotary_factor=0.3125
    )


def test_release_config_spells_the_default_as_the_release_does() -> None:
    cfg = _even_rotary()
    d = release_config(cfg)
    assert d["hybrid_layer_pattern"] == [0 if t == "full_attention" else 1 for t in cfg.layer_types]
    assert d["hybrid_layer_pattern"].count(0) == 2  # layers 0 and 5
    assert d["moe_layer_freq"] == [0] + [1] * 7
    assert d["sliding_window"] == cfg.sliding_window  # the query included, as llama.cpp's n_swa counts
    assert (d["swa_head_dim"], d["swa_v_head_dim"]) == (cfg.head_dim, cfg.v_head_dim)
    assert d["swa_num_key_value_heads"] == 4 and d["num_key_value_heads"] == 2
    assert d["topk_method"] == "noaux_tc" and d["scoring_func"] == "sigmoid"
    assert d["layernorm_epsilon"] == cfg.rms_norm_eps
    assert "rope_parameters" not in d and "layer_types" not in d
    # read back by our own parser, the release spelling gives the same model
    assert DecoderConfig.from_hf_dict(d) == cfg


@pytest.mark.parametrize(
    "change",
    [
        {"swa_partial_rotary_factor": 0.5},
        {"routed_scaling_factor": 2.5},
        {"norm_topk_prob": False},
        {"partial_rotary_factor": 0.334, "swa_partial_rotary_factor": 0.334},  # 21 of 64 dims: odd
    ],
)
def test_a_model_llama_cpp_cannot_express_is_refused(change: dict[str, object]) -> None:
    with pytest.raises(StageError):
        release_config(dataclasses.replace(_even_rotary(), **change))  # type: ignore[arg-type]


def test_stage_links_weights_and_writes_a_tokenizer_config(tmp_path: Path) -> None:
    src = ensure_checkpoint("small", small_config(), DEFAULT_SEED)
    out = stage_checkpoint(src, tmp_path / "staged")
    weights = out / "model.safetensors"
    assert weights.is_symlink() and weights.resolve() == (src / "model.safetensors").resolve()
    assert (
        json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"]
        == "PreTrainedTokenizerFast"
    )
    assert (out / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MiMoV2FlashForCausalLM"]
    # staging twice replaces the links
    stage_checkpoint(src, tmp_path / "staged")


def test_the_embedded_default_itself_is_refused_for_its_odd_rotary(tmp_path: Path) -> None:
    with pytest.raises(StageError, match="rotates 21 of 64"):
        stage_checkpoint(ensure_default_checkpoint(), tmp_path / "staged")


def test_a_checkpoint_without_weights_is_refused(tmp_path: Path) -> None:
    src = ensure_checkpoint("small", small_config(), DEFAULT_SEED)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((src / "config.json").read_bytes())
    with pytest.raises(StageError, match="no safetensors"):
        stage_checkpoint(bare, tmp_path / "staged")
