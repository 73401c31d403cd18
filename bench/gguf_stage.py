"""Convert one of our MiMo-V2-Flash-family checkpoints to an f32 GGUF for llama.cpp (``make peers``
builds the converter): the checkpoint is staged in a directory the converter reads, then
``bench/gguf_convert_entry.py`` runs the converter in its own venv.

What staging changes, and why (the weights are linked, never rewritten):

- ``config.json`` is written in the original release's spelling, which llama.cpp's converter reads
  (``hybrid_layer_pattern``, ``swa_*`` sizes, flat ``rope_theta`` / ``swa_rope_theta`` /
  ``partial_rotary_factor``, ``layernorm_epsilon``, ``topk_method``, ``scoring_func``), from the
  config as our loader parsed it, so both sides run the model we serve. ``sliding_window`` is our
  window, the query included: llama.cpp's ``n_swa`` counts the query too.
- ``tokenizer_config.json`` is written fresh (the converter's transformers < 5 needs a
  ``tokenizer_class``); ``tokenizer.json`` is copied.

A model llama.cpp's MiMo graph cannot express is refused here rather than compared wrongly: one
rotary fraction for all layers and an even rotary width, sigmoid top-k routing without scaling, no
M-RoPE.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from bench.peers import Peers
from llm_core.models.config import FULL, DecoderConfig

WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")


class StageError(ValueError):
    """The checkpoint cannot be converted faithfully; says which setting."""


def release_config(cfg: DecoderConfig) -> dict[str, Any]:
    """``cfg`` as the original release's config.json spells it (what llama.cpp's converter reads)."""
    if cfg.partial_rotary_factor != cfg.swa_partial_rotary_factor:
        raise StageError("llama.cpp's MiMo graph has one rotary fraction for all layers; this model has two")
    if cfg.routed_scaling_factor != 1.0 or not cfg.norm_topk_prob:
        raise StageError("llama.cpp's MiMo graph normalizes the top-k weights and does not scale them")
    if cfg.mrope_section:
        raise StageError("llama.cpp's MiMo graph has 1-D rotary positions (no M-RoPE)")
    rotary = int(cfg.head_dim * cfg.partial_rotary_factor)
    if rotary % 2:
        raise StageError(
            f"llama.cpp rotates an even number of dims; this model rotates {rotary} of {cfg.head_dim}"
            f" (partial_rotary_factor {cfg.partial_rotary_factor})"
        )
    return {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "swa_num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "swa_num_key_value_heads": cfg.swa_num_key_value_heads,
        "head_dim": cfg.head_dim,
        "swa_head_dim": cfg.head_dim,
        "v_head_dim": cfg.v_head_dim,
        "swa_v_head_dim": cfg.v_head_dim,
        "hybrid_layer_pattern": [0 if t == FULL else 1 for t in cfg.layer_types],
        "moe_layer_freq": [1 if t == "sparse" else 0 for t in cfg.mlp_layer_types],
        "sliding_window": cfg.sliding_window,
        "rope_theta": cfg.rope_theta,
        "swa_rope_theta": cfg.swa_rope_theta,
        "partial_rotary_factor": cfg.partial_rotary_factor,
        "attention_value_scale": cfg.attention_value_scale,
        "add_full_attention_sink_bias": cfg.full_attention_sinks,
        "add_swa_attention_sink_bias": cfg.swa_attention_sinks,
        "attention_bias": cfg.attention_bias,
        "layernorm_epsilon": cfg.rms_norm_eps,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "hidden_act": cfg.hidden_act,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "eos_token_id": cfg.eos_token_id,
        "torch_dtype": "float32",
    }


def stage_checkpoint(model_dir: Path, out_dir: Path) -> Path:
    """A directory for the converter: the release-spelled config, links to ``model_dir``'s weight
    files, its tokenizer.json and a fresh tokenizer_config.json. Returns ``out_dir``."""
    cfg = DecoderConfig.from_pretrained_dir(model_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(release_config(cfg), indent=2) + "\n")
    weights = [p for p in sorted(model_dir.iterdir()) if p.name.endswith(WEIGHT_SUFFIXES)]
    if not weights:
        raise StageError(f"{model_dir} has no safetensors weights")
    for p in weights:
        link = out_dir / p.name
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(p.resolve(), link)
    tokenizer = model_dir / "tokenizer.json"
    if not tokenizer.is_file():
        raise StageError(f"{model_dir} has no tokenizer.json (the converter writes the model's vocabulary)")
    (out_dir / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_position_embeddings}
        )
        + "\n"
    )
    return out_dir


def convert_to_gguf(model_dir: Path, out_file: Path, peers: Peers, work_dir: Path) -> Path:
    """``model_dir`` as an f32 GGUF at ``out_file`` (kept: a second run with the file present
    converts nothing). MTP heads are left out (``--no-mtp``): the comparison decodes without drafts."""
    if out_file.is_file():
        return out_file
    staged = stage_checkpoint(model_dir, work_dir / "staged")
    entry = Path(__file__).with_name("gguf_convert_entry.py")
    tmp = out_file.with_suffix(".partial")
    cmd = [
        str(peers.convert_python), str(entry), str(peers.llama_dir), str(staged),
        "--outfile", str(tmp), "--outtype", "f32", "--no-mtp",
    ]  # fmt: skip
    log = work_dir / "convert.log"
    with open(log, "wb") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"GGUF conversion failed (exit {done.returncode}); {log}:\n{tail}")
    tmp.rename(out_file)
    return out_file
