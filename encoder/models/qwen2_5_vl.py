"""The Qwen2.5-VL vision tower (Qwen2.5-VL 3B/7B/72B, MiMo-VL-7B): window + full attention blocks,
2-D rotary, 2x2 patch merger (``encoder.models.tower.VisionTransformer``).

    full model   model_type "qwen2_5_vl", its ``vision_config``; tensors "visual.*" (transformers 5's
                 save_pretrained and the original releases) or "model.visual.*" (transformers 4.5x)
    vision only  model_type "qwen2_5_vl_vision", the tower's fields at the top level; tensors at the
                 top level ("blocks.0...")
"""

from __future__ import annotations

from typing import Any

import torch

from encoder.models.config import VisionConfig
from encoder.models.family import module_shapes, patch_embed_to_conv3d, patch_embed_to_linear
from encoder.models.rope import rope_inv_freq
from encoder.models.tower import VisionTransformer

TENSOR_PREFIXES = ("model.visual.", "visual.", "")


def vision_config(raw: dict[str, Any]) -> dict[str, Any] | None:
    if raw.get("model_type") == "qwen2_5_vl_vision":
        return raw
    vision = raw.get("vision_config")
    return vision if isinstance(vision, dict) else None


def parse_vision_config(vision: dict[str, Any]) -> VisionConfig:
    return VisionConfig.from_hf_dict(vision)


def build_tower(config: VisionConfig) -> VisionTransformer:
    model = VisionTransformer(config)
    if model.inv_freq.is_meta:  # built under torch.device("meta") by the loader: not in the files
        with torch.device("cpu"):
            model.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta)
    return model


def disk_shapes(config: VisionConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return module_shapes(VisionTransformer(config), config)


def to_module_state(config: VisionConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return patch_embed_to_linear(config, tensors)


def to_disk_state(config: VisionConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return patch_embed_to_conv3d(config, state)  # vision-only layout: names at the top level
