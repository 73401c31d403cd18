"""The Qwen2.5-VL family's language model (Qwen2.5-VL 3B/7B/72B, MiMo-VL-7B): ``Qwen2_5_VLForConditionalGeneration``.

The Qwen2 decoder as our shared decoder sees it: every layer full attention (no window, no sinks),
GQA with q/k/v biases, dense SwiGLU MLPs, RMSNorm, tied or untied embeddings, and M-RoPE
(``rope_parameters.mrope_section``; positions from ``positions.MRopePositions``).

Checkpoint spellings (both read):

    transformers 5   config.text_config.*, rope in text_config.rope_parameters; tensors
                     model.language_model.{embed_tokens,layers,norm}.*, lm_head.weight, model.visual.*
    original release flat config, rope_theta + rope_scaling {type: mrope, mrope_section}; tensors
                     model.{embed_tokens,layers,norm}.*, lm_head.weight, visual.*

The vision tower's tensors (``visual.``) belong to the encoder role and are never read here.
"""

from __future__ import annotations

from typing import Any

from llm_core.models.config import FULL, ConfigError, DecoderConfig
from llm_core.models.positions import MRopePositions, PositionScheme

# transformers' default when a config names no section (Qwen2.5-VL's head_dim 128: 64 pairs)
DEFAULT_MROPE_SECTION = (16, 24, 24)


def _text(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields: ``text_config`` over the top level (which older configs use)."""
    text = raw.get("text_config") or {}
    return {**raw, **text}


def parse_config(raw: dict[str, Any]) -> DecoderConfig:
    d = _text(raw)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in d:
            raise ConfigError(f"config.json has no {key!r} (in text_config or at the top level)")
    n, heads, hidden = int(d["num_hidden_layers"]), int(d["num_attention_heads"]), int(d["hidden_size"])
    if d.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported for Qwen2.5-VL (every layer is full)")
    head_dim = int(d.get("head_dim") or hidden // heads)
    rope = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"rope type {rope_type!r} is not supported (only default M-RoPE)")
    section = rope.get("mrope_section") or scaling.get("mrope_section") or DEFAULT_MROPE_SECTION
    theta = rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))
    eos = d.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    tie = raw.get("tie_word_embeddings", d.get("tie_word_embeddings", False))
    kv = int(d.get("num_key_value_heads") or heads)
    max_pos = int(d.get("max_position_embeddings") or 32768)
    return DecoderConfig(
        vocab_size=int(d["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(d["intermediate_size"]),
        moe_intermediate_size=1,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        swa_num_key_value_heads=kv,
        head_dim=head_dim,
        v_head_dim=head_dim,
        sliding_window=max_pos,  # unused: no layer is windowed
        layer_types=(FULL,) * n,
        mlp_layer_types=("dense",) * n,
        rope_theta=float(theta),
        swa_rope_theta=float(theta),
        partial_rotary_factor=1.0,
        swa_partial_rotary_factor=1.0,
        attention_value_scale=1.0,
        full_attention_sinks=False,
        swa_attention_sinks=False,
        attention_bias=True,
        rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
        hidden_act=str(d.get("hidden_act", "silu")),
        tie_word_embeddings=bool(tie),
        max_position_embeddings=max_pos,
        eos_token_id=None if eos is None else int(eos),
        mrope_section=tuple(int(x) for x in section),
        extra=d,
    )


def tensor_name(disk_name: str) -> str | None:
    for prefix in ("model.language_model.", "model."):
        if disk_name.startswith(prefix):
            rest = disk_name[len(prefix) :]
            if rest.startswith("visual."):
                return None
            return f"model.{rest}"
    if disk_name == "lm_head.weight":
        return disk_name
    return None  # visual.* (original release) and anything else is not the language model's


def position_scheme(raw: dict[str, Any]) -> PositionScheme:
    vision = raw.get("vision_config") or {}
    return MRopePositions(
        spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
        tokens_per_second=float(vision.get("tokens_per_second", 2)),
    )
