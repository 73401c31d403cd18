"""The Qwen2.5-VL vision tower (Qwen2.5-VL 3B/7B/72B, MiMo-VL-7B): window + full attention blocks,
2-D rotary, 2x2 patch merger (``encoder.models.tower.VisionTransformer``).

    full model   model_type "qwen2_5_vl", its ``vision_config``; tensors "visual.*" (transformers 5's
                 save_pretrained and the original releases) or "model.visual.*" (transformers 4.5x)
    vision only  model_type "qwen2_5_vl_vision", the tower's fields at the top level; tensors at the
                 top level ("blocks.0...")
"""

from __future__ import annotations

from typing import Any

MODEL_TYPES = ("qwen2_5_vl", "qwen2_5_vl_vision")
TENSOR_PREFIXES = ("model.visual.", "visual.", "")


def vision_config(raw: dict[str, Any]) -> dict[str, Any] | None:
    if raw.get("model_type") == "qwen2_5_vl_vision":
        return raw
    vision = raw.get("vision_config")
    return vision if isinstance(vision, dict) else None
