"""Tiny random MiMo-V2.5 audio weights in the release layout, for the audio encoder's tests.

    <dir>/config.json                  ``model_type`` mimo_v2 with ``audio_config`` and the audio
                                       fields of ``processor_config`` (real key spellings: the
                                       speech_vocab_size / speech_zeroemb_idx strings, ...)
    <dir>/model_audio.safetensors      the main checkpoint's audio tensors: top-level
                                       ``speech_embeddings.{0-19}.weight`` and ``audio_encoder.*``
                                       (input_local_transformer, projection.mlp.{0,2})
    <dir>/audio_tokenizer/config.json  the tokenizer's own config (encoder, decoder and vocoder keys)
    <dir>/audio_tokenizer/model.safetensors
                                       ``encoder.*`` plus what encoding never reads: the quantizer's
                                       training state and a decoder tensor

The structure is the real one (20 channels, codebooks [1024, 1024, 256, 128 x 17], vocab 1280 with
zero-embedding index 1024, groups of 4, a hybrid windowed / full tokenizer with a layer-3 skip,
stride-2 downsample, 2-layer projection); the widths are tiny (d_model 32, 4 tokenizer layers,
2 local layers, hidden 48) and the window short (8 frames) so that short clips cross it. Stored in
float32 (the release is BF16) so that fp32 comparisons measure the code, not the storage.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import save_file

CODEBOOKS = [1024, 1024, 256] + [128] * 17

TOKENIZER_CONFIG: dict[str, Any] = {
    "model_type": "mimo_audio_tokenizer",
    "max_audio_seconds": 1800,
    "stride_size": 2,
    "avg_pooler": 2,
    "d_model": 32,
    "scale_embedding": False,
    "kernel_size": 3,
    "activation_function": "gelu",
    "encoder_layers": 4,
    "encoder_skip_layer_id": 3,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "encoder_causal": False,
    "encoder_attn_window_size": [8, 8],
    "decoder_layers": 2,
    "decoder_attention_heads": 4,
    "decoder_ffn_dim": 64,
    "decoder_kernel_size": 3,
    "decoder_stride_size": 2,
    "decoder_causal": True,
    "decoder_attn_window_size": [8, 0],
    "nfft": 960,
    "vocoder_dim": 16,
    "vocoder_intermediate_dim": 32,
    "vocoder_num_layers": 2,
    "n_mels": 128,
    "sampling_rate": 24000,
    "hop_length": 240,
    "window_size": 960,
    "vocoder_padding": "same",
    "fmin": 0,
    "fmax": None,
    "num_quantizers": 20,
    "codebook_size": CODEBOOKS,
    "threshold_ema_dead_code": 10,
    "position_embedding_type": "rope",
    "rope_theta": 10000,
    "rope_type": "default",
    "ln_type": "LayerNorm",
    "vocoder_attention_heads": 4,
    "vocoder_attn_window_size": [40, 10],
    "use_istft_only": False,
    "hybrid_attention": True,
    "swa_per_block": 2,
}

AUDIO_CONFIG: dict[str, Any] = {
    "audio_channels": 20,
    "audio_segment_size": 6000,
    "group_size": 4,
    "input_full_attention": True,
    "input_local_attn_heads": 4,
    "input_local_dim": 32,
    "input_local_head_dim": 8,
    "input_local_hidden_dropout": 0.0,
    "input_local_intermediate_size": 64,
    "input_local_layers": 2,
    "out_hidden_size": 48,
    "partial_rotary_factor": 1.0,
    "projection_layers": 2,
    "rope_theta": 640000,
    "add_post_norm": True,
    "speech_vocab_size": "1280",
    "speech_zeroemb_idx": "1024",
}

PROCESSOR_AUDIO: dict[str, Any] = {
    "audio_sampling_rate": 24000,
    "audio_nfft": 960,
    "audio_window_size": 960,
    "audio_hop_length": 240,
    "audio_n_mels": 128,
    "audio_fmin": 0,
    "audio_fmax": None,
    "audio_kernel_size": 3,
    "audio_stride_size": 2,
    "audio_avg_pooler": 2,
    "audio_group_size": 4,
    "audio_channels": 20,
    "audio_segment_size": 6000,
    "audio_input_id_per_second": 25.0,
    "audio_zeroemb_idx": [1024] * 20,
}

MAIN_FILE = "model_audio.safetensors"


class TinyAudioCheckpoint(NamedTuple):
    root: Path
    config: dict[str, Any]  # the main config.json
    tokenizer_config: dict[str, Any]  # audio_tokenizer/config.json
    tokenizer_tensors: dict[str, torch.Tensor]
    main_tensors: dict[str, torch.Tensor]


class _Rand:
    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * scale

    def matrix(self, rows: int, *cols: int) -> torch.Tensor:
        fan_in = 1
        for c in cols:
            fan_in *= c
        return self.randn(rows, *cols, scale=fan_in**-0.5)

    def norm(self, dim: int) -> torch.Tensor:
        return 1.0 + self.randn(dim, scale=0.1)

    def bias(self, dim: int) -> torch.Tensor:
        return self.randn(dim, scale=0.1)


def tokenizer_tensors(cfg: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    r = _Rand(seed)
    d, ffn, mels, k = cfg["d_model"], cfg["encoder_ffn_dim"], cfg["n_mels"], cfg["kernel_size"]
    out: dict[str, torch.Tensor] = {
        "encoder.conv1.weight": r.matrix(d, mels, k),
        "encoder.conv1.bias": r.bias(d),
        "encoder.conv2.weight": r.matrix(d, d, k),
        "encoder.conv2.bias": r.bias(d),
        "encoder.layer_norm.weight": r.norm(d),
        "encoder.layer_norm.bias": r.bias(d),
        "encoder.down_sample_layer.0.weight": r.matrix(d, d, cfg["avg_pooler"]),
        "encoder.down_sample_norm.weight": r.norm(d),
        "encoder.down_sample_norm.bias": r.bias(d),
        "decoder.dconv1.conv.weight": r.matrix(d, d, 3),  # read by nobody when encoding
    }
    for i in range(cfg["encoder_layers"]):
        p = f"encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out[f"{p}self_attn.{proj}.weight"] = r.matrix(d, d)
            if proj != "k_proj":
                out[f"{p}self_attn.{proj}.bias"] = r.bias(d)
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            out[f"{p}{norm}.weight"] = r.norm(d)
            out[f"{p}{norm}.bias"] = r.bias(d)
        out[p + "fc1.weight"], out[p + "fc1.bias"] = r.matrix(ffn, d), r.bias(ffn)
        out[p + "fc2.weight"], out[p + "fc2.bias"] = r.matrix(d, ffn), r.bias(d)
    # Codebooks shrinking like a trained RVQ's (each level quantizes what the previous ones left),
    # entries of one norm per level so that the nearest one is picked by direction (random norms
    # would let the few shortest entries win almost every row).
    radius = d**0.5
    for c, size in enumerate(cfg["codebook_size"]):
        p = f"encoder.quantizer.vq.layers.{c}._codebook."
        book = r.randn(size, d)
        out[p + "embed"] = book / book.norm(dim=1, keepdim=True) * radius
        out[p + "embed_avg"] = out[p + "embed"].clone()
        out[p + "cluster_size"] = torch.ones(size)
        out[p + "inited"] = torch.ones(1)
        radius *= 0.7
    return out


def main_tensors(audio: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    r = _Rand(seed)
    dim, inter, group = audio["input_local_dim"], audio["input_local_intermediate_size"], audio["group_size"]
    vocab, zero = int(audio["speech_vocab_size"]), int(audio["speech_zeroemb_idx"])
    out: dict[str, torch.Tensor] = {}
    for c in range(audio["audio_channels"]):
        table = r.randn(vocab, dim, scale=0.3)
        table[zero] = 0.0  # the "empty channel" row, zero as an Embedding's padding_idx leaves it
        out[f"speech_embeddings.{c}.weight"] = table
    t = "audio_encoder.input_local_transformer."
    for i in range(audio["input_local_layers"]):
        p = f"{t}layers.{i}."
        out[p + "input_layernorm.weight"] = r.norm(dim)
        out[p + "post_attention_layernorm.weight"] = r.norm(dim)
        for proj in ("q_proj", "k_proj", "v_proj"):
            out[f"{p}self_attn.{proj}.weight"] = r.matrix(dim, dim)
            out[f"{p}self_attn.{proj}.bias"] = r.bias(dim)
        out[p + "self_attn.o_proj.weight"] = r.matrix(dim, dim)
        out[p + "mlp.gate_proj.weight"] = r.matrix(inter, dim)
        out[p + "mlp.up_proj.weight"] = r.matrix(inter, dim)
        out[p + "mlp.down_proj.weight"] = r.matrix(dim, inter)
    out[t + "norm.weight"] = r.norm(dim)
    flat = group * dim
    out["audio_encoder.projection.mlp.0.weight"] = r.matrix(4 * flat, flat)
    out["audio_encoder.projection.mlp.2.weight"] = r.matrix(audio["out_hidden_size"], 4 * flat)
    return out


def write_tiny_audio_checkpoint(
    root: Path,
    seed: int = 0,
    tokenizer_overrides: dict[str, Any] | None = None,
    audio_overrides: dict[str, Any] | None = None,
) -> TinyAudioCheckpoint:
    """Write the layout above under ``root`` (created) and return what was written."""
    tok_cfg = {**TOKENIZER_CONFIG, **(tokenizer_overrides or {})}
    audio = {**AUDIO_CONFIG, **(audio_overrides or {})}
    processor = {
        **PROCESSOR_AUDIO,
        "audio_group_size": audio["group_size"],
        "audio_segment_size": audio["audio_segment_size"],
    }
    config = {
        "architectures": ["MiMoV2ForCausalLM"],
        "model_type": "mimo_v2",
        "hidden_size": audio["out_hidden_size"],
        "audio_config": audio,
        "processor_config": processor,
    }
    tok = tokenizer_tensors(tok_cfg, seed)
    main = main_tensors(audio, seed + 1)
    (root / "audio_tokenizer").mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    (root / "audio_tokenizer" / "config.json").write_text(json.dumps(tok_cfg, indent=2))
    save_file(
        {k: v.contiguous() for k, v in tok.items()}, str(root / "audio_tokenizer" / "model.safetensors")
    )
    save_file({k: v.contiguous() for k, v in main.items()}, str(root / MAIN_FILE))
    return TinyAudioCheckpoint(root, config, tok_cfg, tok, main)


def tiny_mel(frames: int, seed: int) -> torch.Tensor:
    """A log-mel-like [frames, 128] clip: smooth in time, log-scaled values around -4 +- 2."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(frames, 128, generator=gen)
    smooth = torch.cumsum(base, 0) / (torch.arange(frames)[:, None] + 1).sqrt()
    return (-4.0 + smooth + 0.5 * torch.randn(frames, 128, generator=gen)).float()
