"""The Qwen2.5-VL vision tower: patch embed -> window/full attention blocks -> 2x2 patch merger.

Parameter names match transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` so a checkpoint
maps one to one, except ``patch_embed.proj``: transformers keeps a Conv3d whose stride equals its
kernel, which on pre-cut 1176-value rows is exactly a Linear; the loader reshapes the Conv3d
weight [C, 3, 2, 14, 14] to [C, 1176].

The packing glue (device copies of the layout, the input check, the patch embedding) is
``packed_tower.PackedTower``'s. This module knows nothing of files, batching or HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from encoder.kernels.attention import AttnBackend, varlen_attention
from encoder.kernels.segments import Segments
from encoder.models.config import VisionConfig
from encoder.models.packed_tower import PackedTower
from encoder.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from encoder.models.windows import Grid, VisionLayout, vision_layout


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "quick_gelu": _quick_gelu,
}


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back before the weight (as Qwen2.5-VL does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLPConfig(Protocol):
    """What the MLP reads from a tower config (Qwen2.5-VL's and MiMo ViT's both have it)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def hidden_act(self) -> str: ...  # a key of ACTIVATIONS


class VisionMLP(nn.Module):
    """Gated MLP (SwiGLU for silu): down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not one of {sorted(ACTIVATIONS)}")
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments, backend: AttnBackend
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.num_heads, self.head_dim)  # [N, 3, H, D]
        q, k = apply_rope(qkv[:, :2], cos, sin).unbind(1)  # each [N, H, D]
        o = varlen_attention(q, k, qkv[:, 2], seg, backend)  # [N, H, D]
        return self.proj(o.reshape(n, -1))


class VisionBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm1(x)); x + mlp(norm2(x))."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seg: Segments, backend: AttnBackend
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seg, backend)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm each patch, concatenate each 2x2 group (4 consecutive rows), MLP to out_hidden_size."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.group_dim = cfg.hidden_size * cfg.merge_unit
        self.ln_q = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(self.group_dim, self.group_dim),
            nn.GELU(),
            nn.Linear(self.group_dim, cfg.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.group_dim))  # [N // 4, out]


class VisionTransformer(PackedTower[VisionConfig, VisionLayout]):
    """Qwen2.5-VL vision encoder over packed items.

    ``forward(pixel_values [N, patch_dim], grid_thw [K, 3]) -> [N // merge_unit, out_hidden_size]``:
    items are packed in order and item i's output is its t*h*w // merge_unit consecutive rows, so a
    batch of items gives each item the same rows it gets alone (attention never crosses a frame).
    """

    def __init__(self, cfg: VisionConfig, attn_backend: AttnBackend = "auto") -> None:
        super().__init__(cfg, attn_backend)  # config, attn_backend, patch_embed
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)
        self.inv_freq: torch.Tensor

    def cpu_layout(self, grids: Sequence[Grid]) -> VisionLayout:
        return vision_layout(grids, self.config.spatial_merge_size, self.config.window_merged)

    def encode(self, x: torch.Tensor, layout: VisionLayout) -> torch.Tensor:
        """Window order for the blocks, back to the input order after the merger."""
        cfg = self.config
        n, unit = x.shape[0], cfg.merge_unit
        x = x.view(n // unit, unit, -1)[layout.window_index].reshape(n, -1)  # window order
        cos, sin = rope_cos_sin(layout.positions, self.inv_freq)  # [N, D/2] each
        for i, block in enumerate(self.blocks):
            seg = layout.full if cfg.is_full_attention(i) else layout.window
            x = block(x, cos, sin, seg, self.attn_backend)
        y = self.merger(x)  # [U, out], window order
        return y[layout.reverse_index]  # original order
