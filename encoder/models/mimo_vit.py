"""The MiMo-V2.5 vision tower ("MiMoVL ViT"): patch embed -> full / row-band / column-band GQA
blocks -> 2x2 patch merger (reference: /work/shared/reference/mimo_v25.md section 2).

Parameter names match the checkpoint below ``visual.`` one to one, except ``patch_embed.proj``:
the checkpoint's Conv3d [C, 3, 2, 16, 16] (stride = kernel, no bias) is, on pre-cut 1536-value
rows, exactly a Linear [C, 1536] (the family reshapes it).

Per block (``MiMoVisionConfig.block_mode``): ``x += proj(attn(rms1(x)))``, ``x += down(silu(gate(n))
* up(n))`` with ``n = rms2(x)``; attention is GQA with qkv rows [Q | K | V] contiguous, 2-D rotary
on q and k, within one frame, and on banded blocks limited to +-band positions in the current
order plus the sinks. A run of column blocks permutes the sequence into the column order and the
rotary tables with it (``mimo_layout``); the order is restored before the merger.

Where the sources disagree this follows the checkpoint's own code (R1, transcribing
``modeling_mimo_v2.py``): sinks are a bias on key 0's logit after the band mask (see
``encoder/kernels/band_attention.py``), and the merger's norm is a LayerNorm with weight only
(bias 0, eps 1e-6) rather than sglang's / vLLM's RMSNorm.

The packing glue (device copies of the layout, the input check, the patch embedding) is
``packed_tower.PackedTower``'s; the MLP is Qwen2.5-VL's (``tower.VisionMLP``). This module knows
nothing of files, batching or HTTP.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from encoder.kernels.attention import AttnBackend
from encoder.kernels.band_attention import band_attention
from encoder.kernels.segments import Segments
from encoder.models.family import Grid
from encoder.models.mimo_layout import MiMoLayout, mimo_layout, reorder_units
from encoder.models.mimo_vit_config import BlockMode, MiMoVisionConfig
from encoder.models.packed_tower import PackedTower
from encoder.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from encoder.models.tower import RMSNorm, VisionMLP


class MiMoVisionAttention(nn.Module):
    """GQA self-attention: qkv [N, C] -> [N, (Hq + 2 Hkv) * D] split [Q | K | V]; proj Hq*D -> C."""

    def __init__(self, cfg: MiMoVisionConfig, mode: BlockMode) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.band = mode.band
        self.qkv = nn.Linear(cfg.hidden_size, cfg.qkv_rows)
        self.proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
        self.sinks: nn.Parameter | None = nn.Parameter(torch.zeros(cfg.num_heads)) if mode.sinks else None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: Segments, backend: AttnBackend
    ) -> torch.Tensor:
        n = x.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x)  # [N, (Hq + 2 Hkv) * D]
        q = qkv[:, : hq * d].view(n, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # fp32 math, cast back
        o = band_attention(q, k, v, frames, self.band, self.sinks, backend)  # [N, Hq, D]
        return self.proj(o.reshape(n, hq * d))


class MiMoVisionBlock(nn.Module):
    def __init__(self, cfg: MiMoVisionConfig, mode: BlockMode) -> None:
        super().__init__()
        self.mode = mode
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = MiMoVisionAttention(cfg, mode)
        self.mlp = VisionMLP(cfg)  # the same SwiGLU with biases as Qwen2.5-VL's

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frames: Segments, backend: AttnBackend
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, frames, backend)
        return x + self.mlp(self.norm2(x))


class WeightOnlyLayerNorm(nn.Module):
    """LayerNorm with a weight and no bias (the checkpoint stores only ``ln_q.weight``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, None, self.eps)


class MiMoPatchMerger(nn.Module):
    """LayerNorm each patch, concatenate each unit's 4 rows, Linear -> exact GELU -> Linear, no biases."""

    def __init__(self, cfg: MiMoVisionConfig) -> None:
        super().__init__()
        self.group_dim = cfg.hidden_size * cfg.merge_unit
        self.ln_q = WeightOnlyLayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = nn.Sequential(
            nn.Linear(self.group_dim, self.group_dim, bias=False),
            nn.GELU(),
            nn.Linear(self.group_dim, cfg.out_hidden_size, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.group_dim))  # [N // 4, out]


class MiMoVisionTransformer(PackedTower[MiMoVisionConfig, MiMoLayout]):
    """MiMo ViT over packed items (a ``family.VisionTower``).

    ``forward(pixel_values [N, 1536], grid_thw [K, 3]) -> [N // 4, out_hidden_size]``: rows in
    (C=3, T=2, 16, 16) order, frame by frame, merge units of 4 consecutive rows; item i's output is
    its t*h*w // 4 consecutive rows in unit raster order, frames in time order. Attention never
    crosses a frame, so a batch gives each item the rows it gets alone.
    """

    def __init__(self, cfg: MiMoVisionConfig, attn_backend: AttnBackend = "auto") -> None:
        super().__init__(cfg, attn_backend)  # config, attn_backend, patch_embed
        self.blocks = nn.ModuleList([MiMoVisionBlock(cfg, cfg.block_mode(i)) for i in range(cfg.depth)])
        self.merger = MiMoPatchMerger(cfg)
        # Made on the CPU even under torch.device("meta") (the loader assigns only the state dict).
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta)  # [D/4]
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.inv_freq: torch.Tensor

    def cpu_layout(self, grids: Sequence[Grid]) -> MiMoLayout:
        return mimo_layout(grids, self.config.spatial_merge_size)

    def encode(self, x: torch.Tensor, layout: MiMoLayout) -> torch.Tensor:
        """Row order, switching to the column order for each run of column blocks (the rotary
        tables move with it); back in row order for the merger."""
        unit = self.config.merge_unit
        row_cos, row_sin = rope_cos_sin(layout.positions, self.inv_freq)  # [N, D/2] each, fp32
        col_cos = col_sin = None  # built when the first column block comes
        in_column = False
        for block in cast(Iterable[MiMoVisionBlock], self.blocks):
            if block.mode.column != in_column:  # entering or leaving a run of column blocks
                x = reorder_units(x, layout.column_index if block.mode.column else layout.row_index, unit)
                in_column = block.mode.column
            if in_column:
                if col_cos is None or col_sin is None:
                    col_cos = reorder_units(row_cos, layout.column_index, unit)
                    col_sin = reorder_units(row_sin, layout.column_index, unit)
                x = block(x, col_cos, col_sin, layout.frames, self.attn_backend)
            else:
                x = block(x, row_cos, row_sin, layout.frames, self.attn_backend)
        if in_column:
            x = reorder_units(x, layout.row_index, unit)
        return self.merger(x)  # [U, out], unit raster order
