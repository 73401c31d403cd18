"""MiMo-V2.5 (``MiMoV2ForCausalLM``, model_type ``mimo_v2``): the language model of Xiaomi's release.

The decoder is MiMo-V2-Flash's (the shared decoder: hybrid full / sliding-window attention with
sinks, sigmoid-routed MoE without shared experts, dense layer 0); what differs is the checkpoint:

    config.json    flat (vision_config, audio_config, processor_config beside the text fields), the
                   original spelling: hybrid_layer_pattern (0 full, 1 SLIDING), moe_layer_freq,
                   swa_num_key_value_heads / swa_rope_theta, layernorm_epsilon; sliding_window_size
                   = previous tokens, the query comes on top (128 -> 129 keys, as sglang attends and
                   transformers' MiMoV2FlashConfig converts it), and it wins over the
                   ``sliding_window`` key the same config also carries (128 too). The release's
                   ``attention_chunk_size`` (= the window) is not read: SWA layers are the window.
    tensors        model.layers.N.self_attn.qkv_proj.weight: q/k/v fused and interleaved by
                   tensor-parallel rank (``fused_qkv``, ranks = num_key_value_heads);
                   FP8 e4m3 weights with 128x128 ``weight_scale_inv`` blocks (``fp8``), except
                   o_proj (BF16: quantization_config.ignored_layers), norms, sinks, embeddings and
                   lm_head (BF16) and the router (``mlp.gate.*``, fp32)
    shards         model_pp0_ep0_shard*.safetensors + model_mtp.safetensors, listed by
                   model.safetensors.index.json; the vision tower (``visual.*``) and audio
                   (``speech_embeddings.*``, ``audio_encoder.*``, ...) are not read here, so shards
                   holding only them are never opened
    MTP            model.mtp.layers.{0,1,2}.* -> ``mtp.`` names, loaded into ``mtp.MTPHeads``

Whether a weight is FP8 is read from its stored dtype: an FP8 tensor needs its scale beside it, a
scale needs an FP8 tensor, and everything else is taken as stored.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from llm_core.models.config import FULL, SLIDING, ConfigError, DecoderConfig
from llm_core.models.family import TensorConverter, TensorFormatError
from llm_core.models.fp8 import SCALE_SUFFIX, BlockFP8, is_fp8, scale_name
from llm_core.models.fused_qkv import FusedQKVLayout, SliceToWeight, split_fused_qkv
from llm_core.models.mtp import MTP_PREFIX
from llm_core.models.positions import LinearPositions, PositionScheme
from llm_core.prompts.media_expansion import MediaExpansion, TimestampedVideo

FUSED_QKV = "self_attn.qkv_proj.weight"
_LAYER = re.compile(r"^(model\.layers|mtp\.layers)\.(\d+)\.")


def parse_config(raw: dict[str, Any]) -> DecoderConfig:
    """config.json -> DecoderConfig, refusing what the shared decoder does not compute."""
    checks: tuple[tuple[str, tuple[Any, ...]], ...] = (
        ("attention_projection_layout", (None, "fused_qkv")),
        ("scoring_func", (None, "sigmoid")),
        ("topk_method", (None, "noaux_tc")),
        ("hybrid_block_size", (None,)),
    )
    for key, allowed in checks:
        if raw.get(key) not in allowed:
            raise ConfigError(f"{key}={raw[key]!r} is not supported (expected one of {list(allowed)})")
    if raw.get("n_shared_experts"):
        raise ConfigError(f"n_shared_experts={raw['n_shared_experts']!r} is not supported (MiMo has none)")
    scaling = raw.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default" or scaling.get("mrope_section"):
        raise ConfigError(f"rope_scaling={scaling!r} is not supported (MiMo-V2.5 uses plain 1-D RoPE)")
    config = DecoderConfig.from_hf_dict(raw)
    if config.mrope_section:
        raise ConfigError("mrope_section is not supported for MiMo-V2.5")
    if raw.get("attention_projection_layout") == "fused_qkv":
        _qkv_layouts(config)  # ConfigError naming the head count that does not split over the ranks
    return config


def tensor_name(disk_name: str) -> str | None:
    if disk_name.startswith("model.mtp."):
        return MTP_PREFIX + disk_name.removeprefix("model.mtp.")
    if disk_name.startswith("model.visual."):
        return None  # the tower under vLLM's name for it (the encoder reads it)
    if disk_name.startswith("model.") or disk_name == "lm_head.weight":
        return disk_name
    return None  # visual.* (the encoder's), speech_embeddings.* / audio_encoder.* (audio), others


def position_scheme(raw: dict[str, Any]) -> PositionScheme:
    return LinearPositions()  # rope_scaling has no mrope_section: one position per token


def _qkv_layouts(config: DecoderConfig) -> dict[str, FusedQKVLayout]:
    """The fused projection's geometry per layer type; the rank count is the full layers' KV heads."""
    ranks = config.num_key_value_heads
    return {
        kind: FusedQKVLayout(config.num_attention_heads, kv, config.head_dim, config.v_head_dim, ranks)
        for kind, kv in ((FULL, config.num_key_value_heads), (SLIDING, config.swa_num_key_value_heads))
    }


def _layer_type(name: str, config: DecoderConfig) -> str:
    """FULL or SWA for a ``model.layers.N.`` name (by the config) or an MTP head (always SLIDING)."""
    m = _LAYER.match(name)
    if m is None:
        raise TensorFormatError(f"tensor {name!r}: a fused qkv_proj outside a decoder layer")
    if m.group(1) == "mtp.layers":
        return SLIDING
    i = int(m.group(2))
    if i >= config.num_hidden_layers:
        raise TensorFormatError(f"unexpected tensor {name!r} (num_hidden_layers={config.num_hidden_layers})")
    return config.layer_types[i]


def _disk_name(name: str) -> str:
    """The checkpoint's spelling of a state-dict name, for error messages."""
    return "model.mtp." + name.removeprefix(MTP_PREFIX) if name.startswith(MTP_PREFIX) else name


def tensor_converter(raw: dict[str, Any], config: DecoderConfig, dtype: torch.dtype) -> TensorConverter:
    """The stored tensors -> the decoder's (and MTP heads') state dict: FP8 weights dequantized to
    ``dtype`` (``fp8.BlockFP8.module_weight``), each fused qkv_proj split into q/k/v_proj
    (``fused_qkv``). Raises ``TensorFormatError`` naming the tensor."""
    quant = raw.get("quantization_config")
    fmt = BlockFP8.from_quantization_config(quant) if quant else None  # ConfigError on a bad field
    layouts: dict[str, FusedQKVLayout] = {}  # made when the first fused qkv_proj comes

    def to_weight(name: str, weight: Tensor, scale: Tensor | None, scale_label: str) -> Tensor:
        if scale is None:
            return weight
        assert fmt is not None
        return fmt.module_weight(name, weight, scale, dtype, scale_label)

    def rank_slice_weight(sname: str) -> SliceToWeight:
        """``to_weight`` for one rank's rows of a fused qkv_proj (errors name the rows and scales)."""

        def one(weight: Tensor, scale: Tensor | None, label: str) -> Tensor:
            return to_weight(label, weight, scale, f"{sname} (that rank's scale rows)")

        return one

    def convert(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        scales = {n: tensors.pop(n) for n in [n for n in tensors if n.endswith(SCALE_SUFFIX)]}
        out: dict[str, Tensor] = {}
        for name in list(tensors):
            t = tensors.pop(name)  # dropped as converted: the stored copy is freed before the next
            disk, sname = _disk_name(name), scale_name(_disk_name(name))
            scale = scales.pop(scale_name(name), None)
            if is_fp8(t):
                if fmt is None:
                    raise TensorFormatError(
                        f"tensor {disk!r} is {t.dtype} but config.json has no quantization_config"
                    )
                if scale is None:
                    raise TensorFormatError(
                        f"missing tensor {sname!r}: the block scales of FP8 tensor {disk!r}"
                    )
            elif scale is not None:
                raise TensorFormatError(
                    f"unexpected tensor {sname!r}: {disk!r} is stored as {t.dtype}, not FP8"
                )
            if name.endswith(FUSED_QKV):
                if not layouts:
                    layouts.update(_qkv_layouts(config))
                block = fmt.block_rows if fmt is not None else 1
                q, k, v = split_fused_qkv(
                    disk,
                    t,
                    layouts[_layer_type(name, config)],
                    scale,
                    block,
                    rank_slice_weight(sname),
                    sname,
                )
                prefix = name.removesuffix("qkv_proj.weight")
                out.update(
                    {prefix + "q_proj.weight": q, prefix + "k_proj.weight": k, prefix + "v_proj.weight": v}
                )
            else:
                out[name] = to_weight(disk, t, scale, sname)
        if scales:
            orphan = _disk_name(next(iter(scales)))
            raise TensorFormatError(
                f"unexpected tensor {orphan!r}: no {orphan.removesuffix(SCALE_SUFFIX)!r} beside it"
            )
        return out

    return convert


def media_expansion(raw: dict[str, Any], encode: Callable[[str], list[int]]) -> MediaExpansion:
    """MiMo-V2.5's prompt layout: images and audio clips as pad runs; each video as <|video_start|>,
    per temporal patch its "MM:SS" time and its pads between <|vision_start|> / <|vision_end|>
    (a video with sound: then that stretch's audio pads between <|mimo_audio_start|> /
    <|mimo_audio_end|>), <|video_end|>. The token ids and audio rates are the processor_config
    block's (what the release's processor reads), else the top-level ones; a checkpoint without
    audio ids takes no audio."""
    nested = raw.get("processor_config")
    block: dict[str, Any] = nested if isinstance(nested, dict) else {}

    def token(name: str) -> int:
        value = block.get(name, raw.get(name))
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"config.json: processor_config.{name} must be a token id, got {value!r}")
        return value

    def number(name: str, default: float) -> float:
        value = block.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config.json: processor_config.{name} must be a number, got {value!r}")
        return float(value)

    audio = block.get("audio_token_id", raw.get("audio_token_id")) is not None
    per_second = number("audio_input_id_per_second", 25.0)
    group = number("audio_group_size", 4)
    interleave = number("video_audio_interleave_length", 0.0)
    if interleave < 0 and interleave != -1:
        raise ConfigError(
            f"config.json: processor_config.video_audio_interleave_length must be -1, 0 or > 0, got {interleave}"
        )
    if audio and (per_second <= 0 or group <= 0):
        raise ConfigError(
            "config.json: processor_config.audio_input_id_per_second and audio_group_size must be > 0"
        )
    return TimestampedVideo(
        image_token_id=token("image_token_id"),
        video_token_id=token("video_token_id"),
        vision_start_token_id=token("vision_start_token_id"),
        vision_end_token_id=token("vision_end_token_id"),
        video_start_token_id=token("video_start_token_id"),
        video_end_token_id=token("video_end_token_id"),
        encode=encode,
        audio_token_id=token("audio_token_id") if audio else None,
        audio_start_token_id=token("audio_start_token_id") if audio else None,
        audio_end_token_id=token("audio_end_token_id") if audio else None,
        audio_tokens_per_second=per_second / group,
        interleave_length=interleave,
    )
