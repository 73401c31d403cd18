"""Attention backends: a layer's attention between its two projections, over the paged KV pools.

    qkv [T, (H + Hkv) * D + Hkv * Dv]   the qkv projection's rows [ q heads | k heads | v heads ]
    cos, sin [T, width]                 this step's rotary rows for the layer's rotary
    -> rotate the first ``width`` dims of every q and k head, store k and ``v_scale`` * v at the
       layer's ``slots`` [T] of its pools, attend through the page ``table``    -> out [T, H, Dv]

The boundary is the qkv rows (not rotated q, k, v) because the C kernel does rotary, store and
attention in one pass over them. Every backend gives the same results to float32 rounding, and
stores the same bits in the pools; ``kernels.attention`` has the semantics (window, sinks, GQA).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from torch import Tensor

from llm_core.backends.layout import PackedAttention, pack_attention
from llm_core.backends.specs import AttentionSpec
from llm_core.kernels import cpu_attention
from llm_core.kernels.attention import paged_attention, write_kv
from llm_core.kernels.attention_batch import AttentionBatch, LayerKVLike
from llm_core.kernels.rotary import apply_partial_rotary_


class AttentionBackend(ABC):
    """What runs attention; one instance serves every layer of a model."""

    name: ClassVar[str]

    def describe(self) -> str:
        """What runs attention, for /health's ``paths``."""
        return self.name

    def pack_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        o: Tensor,
        q_bias: Tensor | None,
        k_bias: Tensor | None,
        v_bias: Tensor | None,
    ) -> PackedAttention:
        """After-load hook: a layer's projection weights ([out, in]) -> the layout the model
        multiplies by (``layout.pack_attention``; the same for every backend today)."""
        return pack_attention(q, k, v, o, q_bias, k_bias, v_bias)

    @abstractmethod
    def forward(
        self,
        spec: AttentionSpec,
        qkv: Tensor,
        cos: Tensor,
        sin: Tensor,
        sinks: Tensor | None,
        kv: LayerKVLike,
        slots: Tensor,
        table: Tensor,
        batch: AttentionBatch,
    ) -> Tensor:
        """qkv [T, ...] (contiguous; may be overwritten), cos/sin [T, width], sinks [H] or None, the
        layer's pools, slots int64 [T], page table int32 [B, P] -> out [T, H, Dv] (module doc)."""


class _SplitAttention(AttentionBackend):
    """Rotary and KV store in torch, then ``kernels.attention.paged_attention`` with ``kernel``."""

    kernel: ClassVar[str]

    def forward(
        self,
        spec: AttentionSpec,
        qkv: Tensor,
        cos: Tensor,
        sin: Tensor,
        sinks: Tensor | None,
        kv: LayerKVLike,
        slots: Tensor,
        table: Tensor,
        batch: AttentionBatch,
    ) -> Tensor:
        n, heads, kv_heads, dim = qkv.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
        split = spec.qk_width
        qk = qkv[:, :split].view(n, heads + kv_heads, dim)
        v = qkv[:, split:].view(n, kv_heads, spec.v_head_dim) * spec.v_scale
        qk = apply_partial_rotary_(qk, cos, sin)  # [T, H + Hkv, D], one pass over q and k, in qkv
        write_kv(kv.k, kv.v, slots, qk[:, heads:], v)
        return paged_attention(
            qk[:, :heads],
            kv.k,
            kv.v,
            table,
            batch.cu_seqlens_q,
            batch.seq_lens,
            batch.max_seqlen_q,
            spec.scale,
            spec.window,
            sinks,
            self.kernel,
        )


class TorchAttention(_SplitAttention):
    """The reference: gathers pages and runs a masked softmax in fp32 (any device, any dtype)."""

    name = "torch"
    kernel = "torch"

    def describe(self) -> str:
        return "torch (gathered pages, masked softmax)"


class TritonAttention(_SplitAttention):
    """The Triton prefill and decode kernels (``kernels.triton_attention``); CUDA tensors."""

    name = "triton"
    kernel = "triton"

    def describe(self) -> str:
        return "Triton paged prefill/decode kernels"


class CpuAttention(AttentionBackend):
    """The C kernel (``kernels.cpu_attention.qkv_attention_cpu``): rotary, store and attention in
    one call; fp32 CPU tensors."""

    name = "cpu"

    def describe(self) -> str:
        return f"C paged attention ({cpu_attention.simd()})"

    def forward(
        self,
        spec: AttentionSpec,
        qkv: Tensor,
        cos: Tensor,
        sin: Tensor,
        sinks: Tensor | None,
        kv: LayerKVLike,
        slots: Tensor,
        table: Tensor,
        batch: AttentionBatch,
    ) -> Tensor:
        return cpu_attention.qkv_attention_cpu(
            qkv,
            cos,
            sin,
            slots,
            kv.k,
            kv.v,
            table,
            batch.cu_seqlens_q,
            batch.seq_lens,
            spec.num_heads,
            spec.scale,
            spec.window,
            sinks,
            spec.v_scale,
        )
