"""Feed-forward blocks: the dense SwiGLU MLP (layer 0) and the sigmoid-routed MoE (other layers).

Routing (DeepSeek-V3 "noaux_tc" style, no shared experts):

    scores  = sigmoid(x @ W_router^T)                       [T, E]   fp32
    choice  = scores + e_score_correction_bias              (bias steers selection only)
    groups  : E experts in n_group groups; a group's score is the sum of its top-2 choices;
              keep the best topk_group groups, mask the rest to -inf
    experts = top-k(choice)                                 [T, K]
    weights = scores[experts] (/ their sum if norm_topk_prob) * routed_scaling_factor

The router and the experts run through the layer's MoE backend (``backends.moe``: the torch
reference, or the C kernels on CPU in fp32), whose pack hook lays the expert and dense-MLP weights
out (``after_load``). Parameter names follow transformers' in-memory layout
(``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]); checkpoint.py converts
per-expert checkpoints into it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llm_core.backends.moe import MoEBackend, Routing
from llm_core.backends.moe_torch import TorchMoE
from llm_core.backends.specs import RoutingSpec
from llm_core.models.config import DecoderConfig

__all__ = ["DenseMLP", "GroupedExperts", "Routing", "SparseMoE", "TopKRouter"]

# What the modules run until ``after_load`` gives them the engine's backend.
REFERENCE_MOE: MoEBackend = TorchMoE()


class DenseMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        # gate and up stacked [2I, hidden] by the pack hook (``after_load``; one matmul); not saved.
        self.gate_up_weight: Tensor | None
        self.register_buffer("gate_up_weight", None, persistent=False)

    @torch.no_grad()
    def after_load(self, backend: MoEBackend) -> None:
        """Take the layout ``backend``'s pack hook gives: gate/up stacked and down_proj, both
        input-major (``backends.layout``). Torch computes this MLP whatever the backend; call again
        after the weights change."""
        packed = backend.pack_dense(self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        self.gate_up_weight = packed.gate_up_weight
        self.down_proj.weight.data = packed.down_weight

    def forward(self, x: Tensor) -> Tensor:
        """The dense reference's: the modules' own gate and up projections."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_packed(self, x: Tensor) -> Tensor:
        """A paged forward's: gate and up in one product, by the stacked weight ``after_load`` packed."""
        assert self.gate_up_weight is not None, "a paged forward needs after_load's packed weights"
        gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class TopKRouter(nn.Module):
    """Sigmoid scores with a selection-only bias and group-limited top-k. Kept in fp32."""

    e_score_correction_bias: Tensor

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, config.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        self.spec = RoutingSpec(
            self.num_experts, self.top_k, self.n_group, self.topk_group, self.norm_topk_prob, self.scaling
        )
        self.backend: MoEBackend = REFERENCE_MOE

    def forward(self, x: Tensor) -> Routing:
        """x [T, H] -> Routing(experts [T, K], weights [T, K]), by the MoE backend."""
        return self.backend.route(x, self.weight, self.e_score_correction_bias, self.spec)


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked tensors; computed grouped by expert."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.backend: MoEBackend = REFERENCE_MOE
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    @torch.no_grad()
    def after_load(self, backend: MoEBackend) -> None:
        """Take ``backend`` and the layout its pack hook gives the expert weights (``backends.layout``:
        the same shapes, values and names, stored [E, in, out]; the old storage is freed)."""
        gate_up, down = backend.pack_experts(self.gate_up_proj, self.down_proj)
        self.gate_up_proj.data, self.down_proj.data = gate_up, down
        self.backend = backend

    def forward(self, x: Tensor, routing: Routing) -> Tensor:
        """x [T, H] -> sum_k weights[t, k] * expert_{experts[t, k]}(x[t]), [T, H] in x's dtype, by
        the MoE backend."""
        return self.backend.experts(x, routing, self.gate_up_proj, self.down_proj)


class SparseMoE(nn.Module):
    """Router + grouped experts (MiMo-V2-Flash has no shared experts)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = GroupedExperts(
            config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        )

    def after_load(self, backend: MoEBackend) -> None:
        self.gate.backend = backend
        self.experts.after_load(backend)

    def forward(self, x: Tensor) -> Tensor:
        return self.experts(x, self.gate(x))

    def forward_packed(self, x: Tensor) -> Tensor:
        """A paged forward's (the experts have one layout: ``after_load`` re-lays them in place)."""
        return self.experts(x, self.gate(x))
