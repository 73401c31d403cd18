"""Checkpoint loading: layouts transformers and the original release write, strictness with errors
that name the tensor, and config parsing of both config.json spellings."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llm_core.models.checkpoint import CheckpointError, default_llm_config, load_llm, write_checkpoint
from llm_core.models.config import FULL, SLIDING, ConfigError, DecoderConfig
from llm_core.models.decoder import DecoderForCausalLM
from llm_core.models.random_init import init_random_weights


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite(dir_: Path, edit: dict[str, torch.Tensor | None]) -> None:
    """Apply edits (None = delete) to model.safetensors."""
    path = dir_ / "model.safetensors"
    tensors = load_file(str(path))
    for name, t in edit.items():
        if t is None:
            del tensors[name]
        else:
            tensors[name] = t
    save_file(tensors, str(path))


def same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_loads_what_transformers_writes(tiny_mimo_dir: Path, tiny_mimo_hf: torch.nn.Module) -> None:
    loaded = load_llm(tiny_mimo_dir)
    ours = loaded.model.state_dict()
    theirs = tiny_mimo_hf.state_dict()
    assert torch.equal(ours["model.layers.1.self_attn.sinks"], theirs["model.layers.1.self_attn.sinks"])
    assert torch.equal(
        ours["model.layers.3.mlp.experts.gate_up_proj"], theirs["model.layers.3.mlp.experts.gate_up_proj"]
    )
    assert torch.equal(
        ours["model.layers.3.mlp.gate.e_score_correction_bias"],
        theirs["model.layers.3.mlp.gate.e_score_correction_bias"],
    )
    assert loaded.model_dir == tiny_mimo_dir
    assert not any(p.requires_grad for p in loaded.model.parameters())


def test_fused_expert_layout_and_mtp_and_shards(tiny_mimo_dir: Path, tmp_path: Path) -> None:
    """Fused experts + sink name as in memory + model.mtp.* extras, split over two indexed shards."""
    ref = load_llm(tiny_mimo_dir).model
    out = tmp_path / "fused"
    out.mkdir()
    shutil.copy(tiny_mimo_dir / "config.json", out / "config.json")
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    state["model.mtp.layers.0.proj.weight"] = torch.zeros(3, 3)
    names = sorted(state)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(out / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    assert same_params(load_llm(out).model, ref)


def test_missing_tensor_is_named(tiny_mimo_dir: Path, tmp_path: Path) -> None:
    d = copy_ckpt(tiny_mimo_dir, tmp_path / "c")
    rewrite(d, {"model.layers.2.self_attn.k_proj.weight": None})
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight"):
        load_llm(d)


def test_missing_expert_is_named(tiny_mimo_dir: Path, tmp_path: Path) -> None:
    d = copy_ckpt(tiny_mimo_dir, tmp_path / "c")
    rewrite(d, {"model.layers.4.mlp.experts.3.up_proj.weight": None})
    with pytest.raises(CheckpointError, match=r"model\.layers\.4\.mlp\.experts\.3\.up_proj\.weight"):
        load_llm(d)


def test_shape_mismatch_is_named(tiny_mimo_dir: Path, tmp_path: Path) -> None:
    d = copy_ckpt(tiny_mimo_dir, tmp_path / "c")
    rewrite(d, {"model.layers.1.self_attn.v_proj.weight": torch.zeros(8, 64)})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight.*shape"):
        load_llm(d)


def test_unexpected_tensor_is_named(tiny_mimo_dir: Path, tmp_path: Path) -> None:
    d = copy_ckpt(tiny_mimo_dir, tmp_path / "c")
    rewrite(d, {"model.layers.1.self_attn.q_norm.weight": torch.ones(32)})
    with pytest.raises(
        CheckpointError, match=r"unexpected tensor 'model\.layers\.1\.self_attn\.q_norm\.weight'"
    ):
        load_llm(d)


def test_bad_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_llm(tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        load_llm(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_llm(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(
        CheckpointError,
        match="architecture LlamaForCausalLM is not supported; supported: MiMoV2FlashForCausalLM, "
        "MiMoV2ForCausalLM, Qwen2_5_VLForConditionalGeneration",
    ):
        load_llm(tmp_path)


def test_bf16_load_keeps_router_fp32(tiny_mimo_dir: Path) -> None:
    model = load_llm(tiny_mimo_dir, dtype=torch.bfloat16).model
    assert model.model.layers[1].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    logits = model.forward_dense(torch.arange(20)[None])
    assert logits.isfinite().all()


def test_config_original_release_spelling() -> None:
    d = {
        "vocab_size": 1000,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "swa_num_key_value_heads": 8,
        "head_dim": 32,
        "v_head_dim": 16,
        "hybrid_layer_pattern": [0, 1, 1, 0],
        "moe_layer_freq": [0, 1, 0, 1],
        "sliding_window_size": 127,
        "rope_theta": 5e6,
        "swa_rope_theta": 1e4,
        "partial_rotary_factor": 0.5,
        "layernorm_epsilon": 1e-6,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": None,
        "add_full_attention_sink_bias": False,
        "add_swa_attention_sink_bias": True,
    }
    cfg = DecoderConfig.from_hf_dict(d)
    assert cfg.layer_types == (FULL, SLIDING, SLIDING, FULL)
    assert cfg.mlp_layer_types == ("dense", "sparse", "dense", "sparse")
    assert cfg.sliding_window == 128  # window size excludes the query in this spelling
    assert cfg.num_kv_heads(0) == 2 and cfg.num_kv_heads(1) == 8
    assert cfg.rope_theta_of(1) == 1e4 and cfg.rotary_dim(0) == 16
    assert cfg.routed_scaling_factor == 1.0 and cfg.rms_norm_eps == 1e-6
    assert cfg.has_sinks(1) and not cfg.has_sinks(0)
    assert DecoderConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"layer_types": [FULL, "local"]}, "layer_types"),
        ({"n_group": 3}, "n_group"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"swa_head_dim": 48}, "swa_head_dim"),
    ],
)
def test_config_errors_name_the_field(edit: dict[str, object], field: str) -> None:
    base = default_llm_config().to_hf_dict()
    base.update(edit)
    if field == "layer_types":
        base["num_hidden_layers"] = 2
        base["mlp_layer_types"] = ["dense", "sparse"]
    with pytest.raises(ConfigError, match=field):
        DecoderConfig.from_hf_dict(base)


def test_quantized_checkpoint_is_refused_by_name(tiny_mimo_dir: Path, tmp_path: Path) -> None:
    d = copy_ckpt(tiny_mimo_dir, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quant_method='fp8'"):
        load_llm(d)


def test_tied_embeddings_round_trip(tmp_path: Path) -> None:
    cfg = dataclasses.replace(
        default_llm_config(),
        tie_word_embeddings=True,
        num_hidden_layers=2,
        layer_types=(),
        mlp_layer_types=(),
    )
    model = DecoderForCausalLM(cfg)
    init_random_weights(model, seed=1)
    write_checkpoint(model, tmp_path)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    loaded = load_llm(tmp_path).model
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.arange(5)[None]
    torch.testing.assert_close(loaded.forward_dense(ids), model.forward_dense(ids))
