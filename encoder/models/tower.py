"""The Qwen2.5-VL vision tower: patch embed -> window/full attention blocks -> 2x2 patch merger.

Parameter names match transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` so a checkpoint
maps one to one, except ``patch_embed.proj``: transformers keeps a Conv3d whose stride equals its
kernel, which on pre-cut 1176-value rows is exactly a Linear; the loader reshapes the Conv3d
weight [C, 3, 2, 14, 14] to [C, 1176].

This module knows nothing of files, batching or HTTP.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from encoder.kernels.attention import AttnBackend, varlen_attention
from encoder.models.config import VisionConfig
from encoder.models.rope import apply_rope, rope_cos_sin, rope_inv_freq
from encoder.models.windows import Grid, Segments, VisionLayout, vision_layout


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


class VisionMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, cfg: VisionConfig) -> None:
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


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.to(self.proj.weight.dtype))


class VisionTransformer(nn.Module):
    """Qwen2.5-VL vision encoder over packed items.

    ``forward(pixel_values [N, patch_dim], grid_thw [K, 3]) -> [N // merge_unit, out_hidden_size]``:
    items are packed in order and item i's output is its t*h*w // merge_unit consecutive rows, so a
    batch of items gives each item the same rows it gets alone (attention never crosses a frame).
    """

    def __init__(self, cfg: VisionConfig, attn_backend: AttnBackend = "auto") -> None:
        super().__init__()
        self.config = cfg
        self.attn_backend: AttnBackend = attn_backend
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta), persistent=False)
        self.inv_freq: torch.Tensor
        self._device_layouts: OrderedDict[tuple[tuple[tuple[int, ...], ...], str], VisionLayout] = (
            OrderedDict()
        )

    @property
    def device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def layout(self, grids: Sequence[Grid]) -> VisionLayout:
        """The token layout of a batch with these grids, on the model's device.

        Built on the CPU (cached per distinct grids) and, off the CPU, kept in a small per-model
        cache of device copies so repeated batch shapes upload nothing.
        """
        cfg = self.config
        cpu_layout = vision_layout(grids, cfg.spatial_merge_size, cfg.window_merged)
        device = self.device
        if device.type == "cpu":
            return cpu_layout
        key = (tuple(tuple(int(x) for x in g) for g in grids), str(device))
        cached = self._device_layouts.get(key)
        if cached is None:
            cached = cpu_layout.to(device)
            self._device_layouts[key] = cached
            while len(self._device_layouts) > 64:
                self._device_layouts.popitem(last=False)
        else:
            self._device_layouts.move_to_end(key)
        return cached

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        return self.forward_layout(pixel_values, self.layout(grids))

    def forward_layout(self, pixel_values: torch.Tensor, layout: VisionLayout) -> torch.Tensor:
        """Forward with a precomputed layout (the batcher builds it off the hot path)."""
        cfg = self.config
        n = layout.positions.shape[0]
        if pixel_values.dim() != 2 or pixel_values.shape != (n, cfg.patch_dim):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, expected ({n}, {cfg.patch_dim}) "
                "from grid_thw"
            )
        layout = layout.to(self.device)
        unit = cfg.merge_unit
        x = self.patch_embed(pixel_values.to(self.device, non_blocking=True))  # [N, C]
        x = x.view(n // unit, unit, -1)[layout.window_index].reshape(n, -1)  # window order
        cos, sin = rope_cos_sin(layout.positions, self.inv_freq)  # [N, D/2] each
        for i, block in enumerate(self.blocks):
            seg = layout.full if cfg.is_full_attention(i) else layout.window
            x = block(x, cos, sin, seg, self.attn_backend)
        y = self.merger(x)  # [U, out], window order
        return y[layout.reverse_index]  # original order
