"""The fixed sizes and settings a backend needs to run a module (frozen; built once per module)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionSpec:
    """One attention layer's sizes. The qkv rows a backend takes are laid out
    ``[ q: num_heads * head_dim | k: num_kv_heads * head_dim | v: num_kv_heads * v_head_dim ]``."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int | None  # sliding window W (counting the query itself); None: full causal
    scale: float  # score scale, head_dim ** -0.5
    v_scale: float  # values are multiplied by this before they are stored

    @property
    def qk_width(self) -> int:
        """Columns of the q and k heads in a qkv row (the part that is rotated)."""
        return (self.num_heads + self.num_kv_heads) * self.head_dim


@dataclass(frozen=True)
class RoutingSpec:
    """A sigmoid router's settings (DeepSeek-V3 "noaux_tc" style; see ``MoEBackend.route``)."""

    num_experts: int
    top_k: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    scaling: float  # routed_scaling_factor
