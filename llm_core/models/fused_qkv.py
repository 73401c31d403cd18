"""A fused q/k/v projection stored interleaved by tensor-parallel rank (MiMo-V2.5's ``qkv_proj``).

The checkpoint was written for an attention tensor-parallel size of ``n`` ranks (MiMo-V2.5: the
full layers' ``num_key_value_heads``, 4; V2.5-Pro 8). Its rows are the ranks' slices one after
the other, each slice its own [Q_r | K_r | V_r]::

    rows   [ Q_0  K_0  V_0 | Q_1  K_1  V_1 | ... | Q_n-1  K_n-1  V_n-1 ]      R rows per rank
    Q_r    query heads r*H/n .. (r+1)*H/n - 1        H/n * head_dim rows
    K_r    KV heads r*Hkv/n .. (r+1)*Hkv/n - 1        Hkv/n * head_dim rows
    V_r    the same KV heads                          Hkv/n * v_head_dim rows

FP8 scales are tiled per rank, not over the whole tensor: rank r owns scale rows
r*ceil(R/128) .. (r+1)*ceil(R/128) - 1, so where R is not a multiple of the block (MiMo-V2.5's full
layers: R = 3392 = 26.5 x 128) the last block of every rank is partial and row i of rank r uses
scale row r*ceil(R/128) + i // 128, not (r*R + i) // 128. Each rank slice is therefore turned
into a weight on its own (``to_weight``: dequantization, or nothing for a float checkpoint) before
its rows are regrouped into the unsharded [Q | K | V] that q_proj / k_proj / v_proj hold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from llm_core.models.config import ConfigError
from llm_core.models.family import TensorFormatError

# (rows of one rank's slice [R, cols], its scale rows or None, a label naming them) -> weight [R, cols]
SliceToWeight = Callable[[Tensor, Tensor | None, str], Tensor]


class QKV(NamedTuple):
    q: Tensor  # [H * head_dim, cols]
    k: Tensor  # [Hkv * head_dim, cols]
    v: Tensor  # [Hkv * v_head_dim, cols]


@dataclass(frozen=True)
class FusedQKVLayout:
    """The geometry of one layer type's fused projection."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    ranks: int  # tensor-parallel slices the rows were written for

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ConfigError(f"the fused qkv_proj needs >= 1 rank, got {self.ranks}")
        for field, heads in (("num_attention_heads", self.num_heads), ("key/value heads", self.num_kv_heads)):
            if heads % self.ranks:
                raise ConfigError(
                    f"{field}={heads} do not split over the fused qkv_proj's {self.ranks} tensor-parallel "
                    "ranks (num_key_value_heads of the full-attention layers)"
                )

    @property
    def q_per_rank(self) -> int:
        return self.num_heads // self.ranks * self.head_dim

    @property
    def k_per_rank(self) -> int:
        return self.num_kv_heads // self.ranks * self.head_dim

    @property
    def v_per_rank(self) -> int:
        return self.num_kv_heads // self.ranks * self.v_head_dim

    @property
    def rows_per_rank(self) -> int:
        return self.q_per_rank + self.k_per_rank + self.v_per_rank

    @property
    def rows(self) -> int:
        return self.ranks * self.rows_per_rank


def _identity(weight: Tensor, scale: Tensor | None, label: str) -> Tensor:
    return weight


def split_fused_qkv(
    name: str,
    weight: Tensor,
    layout: FusedQKVLayout,
    scale: Tensor | None = None,
    block_rows: int = 128,
    to_weight: SliceToWeight = _identity,
    scale_label: str | None = None,
) -> QKV:
    """The rank-interleaved ``weight`` [rows, cols] (and its per-rank tiled ``scale`` rows, when
    quantized in blocks of ``block_rows``) -> unsharded q, k, v weights. Errors name the tensor."""
    label = scale_label or f"{name} scale"
    if weight.dim() != 2:
        raise TensorFormatError(f"tensor {name!r}: a fused qkv_proj is 2-D, got shape {tuple(weight.shape)}")
    rows, n = int(weight.shape[0]), layout.ranks
    if rows % n:
        raise TensorFormatError(
            f"tensor {name!r} has {rows} rows, which do not divide into {n} tensor-parallel rank slices "
            "(ranks = num_key_value_heads of the full-attention layers)"
        )
    if rows != layout.rows:
        raise TensorFormatError(
            f"tensor {name!r} has {rows} rows; the config implies {layout.rows} = {n} ranks x "
            f"[Q {layout.q_per_rank} | K {layout.k_per_rank} | V {layout.v_per_rank}]"
        )
    per = layout.rows_per_rank
    blocks = -(-per // block_rows)  # scale rows of one rank
    if scale is not None and (scale.dim() != 2 or int(scale.shape[0]) != n * blocks):
        raise TensorFormatError(
            f"tensor {label!r} has shape {tuple(scale.shape)}: {name} is tiled per rank, {n} ranks x "
            f"ceil({per} / {block_rows}) = {n * blocks} scale rows"
        )
    qs, ks, vs = [], [], []
    q_end, k_end = layout.q_per_rank, layout.q_per_rank + layout.k_per_rank
    for r in range(n):
        rows_r = weight[r * per : (r + 1) * per]  # [R, cols]: this rank's [Q_r | K_r | V_r]
        scale_r = None if scale is None else scale[r * blocks : (r + 1) * blocks]
        w = to_weight(rows_r, scale_r, f"{name} (rank {r} of {n}: rows {r * per}..{(r + 1) * per - 1})")
        qs.append(w[:q_end])
        ks.append(w[q_end:k_end])
        vs.append(w[k_end:])
    return QKV(torch.cat(qs), torch.cat(ks), torch.cat(vs))
