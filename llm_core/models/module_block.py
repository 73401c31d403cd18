"""The modules runner: a pre-norm block run as the model's own modules, under the layer backends'
``BlockRunner`` interface.

A layer backend that takes a block (``llm_core.backends.layer``: the CPU kernel) runs it in one
call; every other block runs here, through the attention, MoE and norm backends its modules were
given at load::

    first block:  residual = x;                 h = norm1(x)
    later:        residual = residual + x;      h = norm1(residual)      (one fused add + norm)
                  residual = residual + attn(h);  h = norm2(residual)
                  return mlp(h), residual

So a decoder layer (and an MTP head's block) hands its whole paged forward to one runner, whichever
it is; the weights are the packed ones (``backends.layout``: q/k/v and gate/up stacked), the only
layout a paged forward reads. The dense reference (``forward_dense``) keeps the modules' own
weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

from torch import Tensor

from llm_core.backends.layer import LayerStep, PackedLayer
from llm_core.kernels.attention_batch import AttentionBatch, LayerKVLike


class _Norm(Protocol):
    def __call__(self, x: Tensor) -> Tensor: ...

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]: ...


class _PagedAttention(Protocol):
    def forward_paged(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv: LayerKVLike, batch: AttentionBatch
    ) -> Tensor: ...


@dataclass(frozen=True)
class ModuleBlock:
    """What the modules runner runs one block with: its modules (the MLP's packed forward)."""

    norm1: _Norm
    attention: _PagedAttention
    norm2: _Norm
    mlp: Callable[[Tensor], Tensor]  # [T, hidden] -> [T, hidden]


class ModulesRunner:
    """Runs a ``ModuleBlock``; its per-step state is the batch itself."""

    name = "modules"

    def begin(self, batch: AttentionBatch) -> LayerStep:
        return batch

    def hidden_input(self, x: Tensor, owned: bool) -> Tensor:
        return x

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
        block = cast(ModuleBlock, packed)
        if residual is None:
            h, residual = block.norm1(x), x
        else:
            h, residual = block.norm1.add_forward(x, residual)
        h = block.attention.forward_paged(h, cos, sin, kv, cast(AttentionBatch, step))
        h, residual = block.norm2.add_forward(h, residual)
        return block.mlp(h), residual


MODULES = ModulesRunner()
