"""Layer backends: a whole pre-norm block (a decoder layer, or an MTP head's block) in one call.

    residual += x;  h = norm1(residual)              (first block: residual = x)
    residual += attention(h) @ Wo                    (qkv projection, rotary, KV store, attention)
    x = mlp(norm2(residual))                         (dense SwiGLU, or router + routed experts)

``forward`` takes (x, residual) [T, hidden] and returns the block's (x, residual) (residual None:
the first block, where the residual stream starts as x). The model offers each block's parameters
(``BlockParams``, after the attention and MLP weights are packed) to ``pack``; a backend that
supports the block returns what it will run it with, else None, and that block then runs through
the model's modules runner (``llm_core.models.module_block``: the attention, MoE and norm backends
under the same ``BlockRunner`` interface), so a layer always hands its whole forward to one
runner. "none" supports no block; "cpu" is the C decoder-layer kernel (``kernels.cpu_layer``: CPU,
float32 compute over float32 or bf16 weights and KV, input-major weights, x and residual updated
in place).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol, cast

import torch
from torch import Tensor

from llm_core.backends.specs import AttentionSpec, RoutingSpec
from llm_core.kernels import cpu_attention, cpu_layer, cpu_moe
from llm_core.kernels.attention_batch import AttentionBatch, LayerKVLike


@dataclass(frozen=True)
class DenseMlpParams:
    gate_up: Tensor  # [2I, hidden] packed (gate rows first), input-major
    down: Tensor  # [hidden, I] input-major


@dataclass(frozen=True)
class MoEParams:
    router: Tensor  # [E, hidden] fp32
    bias: Tensor  # [E] selection bias
    gate_up: Tensor  # [E, 2I, hidden] input-major
    down: Tensor  # [E, hidden, I] input-major
    spec: RoutingSpec


@dataclass(frozen=True)
class BlockParams:
    """A pre-norm block's parameters, packed (``layout``), as the model offers them."""

    norm1: Tensor  # [hidden]
    norm2: Tensor  # [hidden]
    eps: float  # both norms' (a block whose norms differ is not offered)
    qkv_weight: Tensor  # [(H + Hkv) * D + Hkv * Dv, hidden] input-major
    qkv_bias: Tensor | None
    o_weight: Tensor  # [hidden, H * Dv] input-major
    sinks: Tensor | None  # [H]
    attention: AttentionSpec
    mlp: DenseMlpParams | MoEParams


# What a layer backend runs a block with (opaque to the model).
PackedLayer = object
# A layer backend's per-step state (made once per forward, used by every block).
LayerStep = object


class BlockRunner(Protocol):
    """What runs a whole pre-norm block: a layer backend, or the model's modules runner."""

    def begin(self, batch: AttentionBatch) -> LayerStep:
        """A forward's state, before its first block."""
        ...

    def hidden_input(self, x: Tensor, owned: bool) -> Tensor:
        """The hidden state the first block takes: ``x`` [T, hidden], or the copy this runner
        computes on (``owned``: x is a temporary of the caller's, free to overwrite)."""
        ...

    def forward(
        self,
        packed: PackedLayer,
        step: LayerStep,
        kv: LayerKVLike,
        cos: Tensor,
        sin: Tensor,
        x: Tensor,
        residual: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """One block: (x, residual) [T, hidden] -> the block's (mlp output, residual), whose sum
        is the hidden state after it; residual None: the first block. cos/sin [T, width]."""
        ...


class LayerBackend(BlockRunner, ABC):
    """A kernel backend for whole blocks: ``pack`` takes a block's parameters, and the
    ``BlockRunner`` methods run the blocks it took."""

    name: ClassVar[str]

    def describe(self) -> str:
        """What runs a whole block, for /health's ``paths``."""
        return self.name

    @abstractmethod
    def pack(self, params: BlockParams) -> PackedLayer | None:
        """After-load hook: what this backend runs the block with, or None when it cannot."""

    def hidden_input(self, x: Tensor, owned: bool) -> Tensor:
        return x


class NoLayer(LayerBackend):
    """Supports no block: every block runs as its modules."""

    name = "none"

    def describe(self) -> str:
        return "the model's modules (the attention, MoE and norm backends)"

    def pack(self, params: BlockParams) -> PackedLayer | None:
        return None

    def begin(self, batch: AttentionBatch) -> LayerStep:
        return None

    def forward(
        self,
        packed: PackedLayer,
        step: LayerStep,
        kv: LayerKVLike,
        cos: Tensor,
        sin: Tensor,
        x: Tensor,
        residual: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        raise AssertionError("the 'none' layer backend packs no block")


class CpuLayer(LayerBackend):
    """One C call per block (``cpu_layer.decoder_layer_cpu``), split over torch's intra-op threads."""

    name = "cpu"

    def describe(self) -> str:
        return (
            f"one C call per layer (attention {cpu_attention.simd()}, small-M products {cpu_moe.simd()}; "
            f"torch's sgemm on the layer's threads for prefill and for experts of {cpu_moe.blas_min_rows()}+ rows, "
            f"{cpu_moe.bf16_blas_min_rows()}+ with bf16 weights; bf16 weights as "
            f"{'bf16 products (MKL bf16 GEMM)' if cpu_layer.bf16_products() else 'float32 inputs'}; "
            f"{torch.get_num_threads()} threads)"
        )

    def pack(self, params: BlockParams) -> PackedLayer | None:
        mlp = params.mlp
        if isinstance(mlp, MoEParams):
            r = mlp.spec
            mlp_args = cpu_layer.moe_args(
                mlp.router,
                mlp.bias,
                mlp.gate_up,
                mlp.down,
                r.top_k,
                r.n_group,
                r.topk_group,
                r.norm_topk_prob,
                r.scaling,
            )
        else:
            mlp_args = cpu_layer.dense_mlp_args(mlp.gate_up, mlp.down)
        if mlp_args is None:
            return None
        a = params.attention
        return cpu_layer.layer_weights(
            params.norm1,
            params.norm2,
            params.eps,
            params.qkv_weight,
            params.qkv_bias,
            params.o_weight,
            params.sinks,
            a.num_heads,
            a.num_kv_heads,
            a.head_dim,
            a.v_head_dim,
            a.window,
            a.scale,
            a.v_scale,
            mlp_args,
        )

    def begin(self, batch: AttentionBatch) -> LayerStep:
        cpu_layer.set_threads(torch.get_num_threads())
        return cpu_layer.StepArgs(batch)

    def hidden_input(self, x: Tensor, owned: bool) -> Tensor:
        """The kernel computes in float32 whatever the weights' storage and writes x in place: a
        float32 temporary of the caller's as it is, else a float32 copy."""
        if owned and x.dtype == torch.float32 and x.is_contiguous():
            return x
        return x.to(torch.float32, copy=True, memory_format=torch.contiguous_format)

    def forward(
        self,
        packed: PackedLayer,
        step: LayerStep,
        kv: LayerKVLike,
        cos: Tensor,
        sin: Tensor,
        x: Tensor,
        residual: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        first = residual is None
        if first:  # once per forward: the kernel takes fp32 CPU memory
            assert x.dtype == torch.float32 and x.device.type == "cpu", (x.dtype, x.device)
            residual = torch.empty_like(x)
        assert residual is not None
        cpu_layer.decoder_layer_cpu(
            cast(cpu_layer.LayerWeights, packed),
            cast(cpu_layer.StepArgs, step),
            kv,
            cos,
            sin,
            x,
            residual,
            first,
        )
        return x, residual
