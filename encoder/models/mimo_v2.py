"""The MiMo-V2.5 vision tower (``XiaomiMiMo/MiMo-V2.5``, ``MiMoV2ForCausalLM``): full / row-band /
column-band GQA blocks with sinks, 2-D rotary, 2x2 patch merger
(``encoder.models.mimo_vit.MiMoVisionTransformer``).

    model_type "mimo_v2", config.json's top-level ``vision_config`` (the file is flat: no
    text_config); tensors "visual.*" in BF16 (the released checkpoint), or "model.visual.*" (the
    name vLLM maps from). The tower's tensors sit in their own shards: the loader opens no other.

On disk below the prefix (C = hidden_size, D = head dim, H / Hkv = query / kv heads):
    patch_embed.proj.weight           [C, 3, 2, 16, 16]  Conv3d, no bias (a Linear [C, 1536] here)
    blocks.i.norm1.weight, norm2      [C]                RMSNorm
    blocks.i.attn.qkv.weight, .bias   [(H + 2 Hkv) D, C], [(H + 2 Hkv) D]   rows [Q | K | V]
    blocks.i.attn.proj.weight, .bias  [C, H D], [C]
    blocks.i.attn.sinks               [H]                only on banded blocks, when use_sink
    blocks.i.mlp.{gate,up}_proj       [I, C] + bias [I];  down_proj [C, I] + bias [C]
    merger.ln_q.weight                [C]                LayerNorm, no bias
    merger.mlp.0.weight               [4C, 4C];  merger.mlp.2.weight [out, 4C]   no biases
"""

from __future__ import annotations

from typing import Any

import torch

from encoder.models.family import module_shapes, patch_embed_to_conv3d, patch_embed_to_linear
from encoder.models.mimo_vit import MiMoVisionTransformer
from encoder.models.mimo_vit_config import MiMoVisionConfig

TENSOR_PREFIXES = ("visual.", "model.visual.")
SAVE_PREFIX = "visual."  # what the release uses


def vision_config(raw: dict[str, Any]) -> dict[str, Any] | None:
    vision = raw.get("vision_config")
    return vision if isinstance(vision, dict) else None


def parse_vision_config(vision: dict[str, Any]) -> MiMoVisionConfig:
    return MiMoVisionConfig.from_hf_dict(vision)


def build_tower(config: MiMoVisionConfig) -> MiMoVisionTransformer:
    return MiMoVisionTransformer(config)


def disk_shapes(config: MiMoVisionConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return module_shapes(MiMoVisionTransformer(config), config)


def to_module_state(config: MiMoVisionConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return patch_embed_to_linear(config, tensors)


def to_disk_state(config: MiMoVisionConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {SAVE_PREFIX + name: t for name, t in patch_embed_to_conv3d(config, state).items()}
