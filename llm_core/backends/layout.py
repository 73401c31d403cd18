"""The packed projection weights every backend uses: q/k/v and gate/up stacked into one matrix
each (one matmul instead of two or three), projection weights stored input-major
(``kernels.weight_layout``: same shape and values, [in, out] memory, faster with few rows and the
layout the C kernels read). The default pack hooks of ``AttentionBackend`` and ``MoEBackend``."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from llm_core.kernels.weight_layout import input_major


class PackedAttention(NamedTuple):
    qkv_weight: Tensor  # [(H + Hkv) * D + Hkv * Dv, hidden] input-major: q, k, v rows stacked
    qkv_bias: Tensor | None  # [(H + Hkv) * D + Hkv * Dv] or None
    o_weight: Tensor  # [hidden, H * Dv] input-major (o_proj's values)


class PackedDenseMLP(NamedTuple):
    gate_up_weight: Tensor  # [2I, hidden] input-major: gate rows, then up rows
    down_weight: Tensor  # [hidden, I] input-major


@torch.no_grad()
def pack_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    o: Tensor,
    q_bias: Tensor | None,
    k_bias: Tensor | None,
    v_bias: Tensor | None,
) -> PackedAttention:
    """q/k/v/o projection weights ([out, in] as in the checkpoint) and biases -> the packed layout."""
    biases = [b for b in (q_bias, k_bias, v_bias) if b is not None]
    return PackedAttention(
        input_major(torch.cat([q, k, v])),
        None if q_bias is None else torch.cat(biases),
        input_major(o),
    )


@torch.no_grad()
def pack_dense_mlp(gate: Tensor, up: Tensor, down: Tensor) -> PackedDenseMLP:
    return PackedDenseMLP(input_major(torch.cat([gate, up])), input_major(down))


@torch.no_grad()
def pack_experts(gate_up: Tensor, down: Tensor) -> tuple[Tensor, Tensor]:
    """Stacked expert weights gate_up [E, 2I, H] and down [E, H, I] -> the same shapes and values
    stored [E, in, out]: the layout the C experts kernel reads, and for the torch paths
    bit-identical results (the padded decode path measured ~4% faster)."""
    return input_major(gate_up), input_major(down)
