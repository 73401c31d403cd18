"""The tower's input local transformer: Qwen2 decoder layers run on each group of frames alone.

Input [G, g, dim] (G groups of g = 4 frames); positions 0..g-1 in every group; attention is
bidirectional within the group (``input_full_attention``; causal within it otherwise), never across
groups. Per layer (RMSNorm eps 1e-6, computed in float32):

    x += o_proj(attn(RMSNorm(x)))           q, k, v with bias, RoPE (theta 640000) on q and k
    x += down(silu(gate(n)) * up(n))        n = RMSNorm(x)

then the final ``norm`` when ``add_post_norm``. Parameter names are the checkpoint's below
``audio_encoder.input_local_transformer.``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from encoder.models.mimo_audio.rope import apply_rope, rope_cos_sin
from encoder.models.mimo_audio.tower_config import AudioTowerConfig
from encoder.models.tower import RMSNorm


class LocalAttention(nn.Module):
    def __init__(self, cfg: AudioTowerConfig) -> None:
        super().__init__()
        d = cfg.input_local_dim
        self.heads, self.head_dim = cfg.input_local_attn_heads, cfg.head_dim
        self.causal = not cfg.input_full_attention
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        groups, g, d = x.shape
        q, k, v = (
            p(x).view(groups * g, self.heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (
            t.view(groups, g, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v)
        )  # [G, H, g, D]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.o_proj(o.transpose(1, 2).reshape(groups, g, d))


class LocalMLP(nn.Module):
    def __init__(self, cfg: AudioTowerConfig) -> None:
        super().__init__()
        d, inter = cfg.input_local_dim, cfg.input_local_intermediate_size
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LocalLayer(nn.Module):
    def __init__(self, cfg: AudioTowerConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.input_local_dim, cfg.rms_norm_eps)
        self.self_attn = LocalAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.input_local_dim, cfg.rms_norm_eps)
        self.mlp = LocalMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class InputLocalTransformer(nn.Module):
    """[G, g, dim] -> [G, g, dim]."""

    def __init__(self, cfg: AudioTowerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList([LocalLayer(cfg) for _ in range(cfg.input_local_layers)])
        self.norm: RMSNorm | None = (
            RMSNorm(cfg.input_local_dim, cfg.rms_norm_eps) if cfg.add_post_norm else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups, g, _ = x.shape
        positions = torch.arange(g, device=x.device).repeat(groups)  # [G * g]: 0..g-1 per group
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x if self.norm is None else self.norm(x)
