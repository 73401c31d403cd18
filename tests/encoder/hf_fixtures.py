"""Tiny random Qwen2.5-VL checkpoints written by transformers' own save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_VISION = dict(
    depth=4,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    window_size=56,  # 2x2 merged units per window: inputs of 8x12 patches span several windows
    fullatt_block_indexes=[1, 3],
)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that every part (norm scales, biases) visibly shapes the output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1:].numel() ** -0.5)
            elif "norm" in name or "ln_q" in name:  # norm scales around 1
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:  # biases
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def hf_vision_model(seed: int = 0) -> torch.nn.Module:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    model = Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**TINY_VISION)).eval()
    _randomize(model, seed)
    return model


def save_hf_full_model(vision: torch.nn.Module, path: Path, max_shard_size: str | None = None) -> None:
    """A full Qwen2_5_VLForConditionalGeneration (tiny LLM) whose visual part is ``vision``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        vision_config=dict(TINY_VISION),
        text_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=128,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        ),
        bos_token_id=0,
        eos_token_id=1,
    )
    full = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    full.model.visual.load_state_dict(vision.state_dict())
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    full.save_pretrained(path, **kwargs)
