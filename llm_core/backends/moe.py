"""MoE backends: the sigmoid router and the routed experts of a MoE layer.

Routing (DeepSeek-V3 "noaux_tc" style, no shared experts; ``specs.RoutingSpec``):

    scores  = sigmoid(x @ W_router^T)                       [T, E]   fp32
    choice  = scores + e_score_correction_bias              (bias steers selection only)
    groups  : E experts in n_group groups; a group's score is the sum of its top-2 choices;
              keep the best topk_group groups, mask the rest to -inf
    experts = top-k(choice)                                 [T, K]
    weights = scores[experts] (/ their sum if norm_topk_prob) * routed_scaling_factor

Experts: x [T, H], Routing(experts [T, K], weights [T, K]), gate_up [E, 2I, H], down [E, H, I]
-> out [T, H] = sum_k weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]).

"torch" (``moe_torch``) is the reference; "cpu" runs the C kernels of ``kernels.cpu_moe`` (fp32
CPU; experts laid out by the pack hook). The pack hooks also lay out the dense SwiGLU MLP's weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, NamedTuple

from torch import Tensor

from llm_core.backends.layout import PackedDenseMLP, pack_dense_mlp, pack_experts
from llm_core.backends.specs import RoutingSpec
from llm_core.kernels import cpu_moe


class Routing(NamedTuple):
    experts: Tensor  # int64 [T, K]
    weights: Tensor  # fp32 [T, K]


class MoEBackend(ABC):
    """What runs the router and the experts; one instance serves every MoE layer of a model."""

    name: ClassVar[str]

    def describe(self) -> str:
        """What runs the router and the experts, for /health's ``paths``."""
        return self.name

    def pack_experts(self, gate_up: Tensor, down: Tensor) -> tuple[Tensor, Tensor]:
        """After-load hook: the stacked expert weights -> the layout ``experts`` reads (the same
        shapes and values, stored [E, in, out]; ``layout.pack_experts``)."""
        return pack_experts(gate_up, down)

    def pack_dense(self, gate: Tensor, up: Tensor, down: Tensor) -> PackedDenseMLP:
        """After-load hook: a dense SwiGLU MLP's weights -> gate/up stacked, input-major."""
        return pack_dense_mlp(gate, up, down)

    @abstractmethod
    def route(self, x: Tensor, weight: Tensor, bias: Tensor, spec: RoutingSpec) -> Routing:
        """x [T, H], router weight [E, H] (fp32), selection bias [E] -> Routing (module doc)."""

    @abstractmethod
    def experts(self, x: Tensor, routing: Routing, gate_up: Tensor, down: Tensor) -> Tensor:
        """x [T, H] -> [T, H] in x's dtype (module doc)."""


class CpuMoE(MoEBackend):
    """The C router and experts kernels: one call each per layer (fp32 CPU)."""

    name = "cpu"

    def describe(self) -> str:
        blas = f"; experts of {cpu_moe.blas_min_rows()}+ rows through torch's BLAS" if cpu_moe.BLAS else ""
        return f"C experts and router ({cpu_moe.simd()}{blas})"

    def route(self, x: Tensor, weight: Tensor, bias: Tensor, spec: RoutingSpec) -> Routing:
        return Routing(
            *cpu_moe.route(
                x, weight, bias, spec.top_k, spec.n_group, spec.topk_group, spec.norm_topk_prob, spec.scaling
            )
        )

    def experts(self, x: Tensor, routing: Routing, gate_up: Tensor, down: Tensor) -> Tensor:
        return cpu_moe.moe_experts_cpu(x, routing.experts, routing.weights, gate_up, down)
