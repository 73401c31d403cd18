"""Feed-forward blocks: the dense SwiGLU MLP (layer 0) and the sigmoid-routed MoE (other layers).

Routing (DeepSeek-V3 "noaux_tc" style, no shared experts):

    scores  = sigmoid(x @ W_router^T)                       [T, E]   fp32
    choice  = scores + e_score_correction_bias              (bias steers selection only)
    groups  : E experts in n_group groups; a group's score is the sum of its top-2 choices;
              keep the best topk_group groups, mask the rest to -inf
    experts = top-k(choice)                                 [T, K]
    weights = scores[experts] (/ their sum if norm_topk_prob) * routed_scaling_factor

Experts are computed grouped: the T*K (token, expert) assignments are sorted by expert, each
expert runs one matmul over its contiguous segment, and results are scattered back with the
routing weights (a loop over experts, never over tokens). Small batches (decode) pad every
expert's segment to the largest one and run all experts in two ``bmm`` calls instead. On CPU in
fp32, with the C kernels built, the router and the experts are one call each (``cpu_moe``); the
torch code here is then the reference. Parameter names follow transformers' in-memory layout
(``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]); checkpoint.py converts
per-expert checkpoints into it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llm_core.kernels import cpu_moe
from llm_core.kernels.weight_layout import input_major
from llm_core.models.config import DecoderConfig

# Batches of at most PADDED_MAX_TOKENS tokens (decode steps) run the experts as two padded batched
# matmuls, as long as the padded rows (E * largest expert count) stay within PADDED_WASTE times the
# real (token, expert) assignments; otherwise (prefill) one matmul pair per expert, which is cheaper
# once segments are long (measured on bench.llm: padded is ~7% faster in decode, ~7% slower in prefill).
PADDED_MAX_TOKENS = 64
PADDED_WASTE = 3


class Routing(NamedTuple):
    experts: Tensor  # int64 [T, K]
    weights: Tensor  # fp32 [T, K]


class DenseMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        # gate and up stacked [2I, hidden] by ``fuse_weights`` (one matmul); not saved.
        self.gate_up_weight: Tensor | None
        self.register_buffer("gate_up_weight", None, persistent=False)

    @torch.no_grad()
    def fuse_weights(self) -> None:
        """Stack gate/up for the fused path (stored input-major, and down_proj too: see
        ``weight_layout``); call again after the weights change."""
        self.gate_up_weight = input_major(torch.cat([self.gate_proj.weight, self.up_proj.weight]))
        self.down_proj.weight.data = input_major(self.down_proj.weight.data)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_weight is not None:
            gate, up = F.linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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

    def forward(self, x: Tensor) -> Routing:
        """x [T, H] -> Routing(experts [T, K], weights [T, K]). One kernel call on CPU in fp32."""
        if cpu_moe.supports_route(x, self.weight):
            return Routing(
                *cpu_moe.route(
                    x,
                    self.weight,
                    self.e_score_correction_bias,
                    self.top_k,
                    self.n_group,
                    self.topk_group,
                    self.norm_topk_prob,
                    self.scaling,
                )
            )
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias
        if self.topk_group < self.n_group:
            per_group = self.num_experts // self.n_group
            grouped = choice.view(-1, self.n_group, per_group)  # [T, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = group_scores.topk(self.topk_group, dim=-1).indices  # [T, topk_group]
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)  # [T, G]
            choice = grouped.masked_fill(dropped[:, :, None], float("-inf")).view_as(choice)
        experts = choice.topk(self.top_k, dim=-1).indices  # [T, K]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self.scaling != 1.0:  # x * 1.0 == x: skip the op
            weights = weights * self.scaling
        return Routing(experts, weights)


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked tensors; computed grouped by expert."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    @torch.no_grad()
    def fuse_weights(self) -> None:
        """Store both weights input-major, [E, in, out] in memory (``weight_layout``: same shapes,
        values and names; only the strides change): the layout the C kernel reads, and for the torch
        paths bit-identical results (the padded decode path measured ~4% faster). No extra memory:
        the old storage is freed."""
        for p in (self.gate_up_proj, self.down_proj):
            p.data = input_major(p.data)

    def forward(self, x: Tensor, routing: Routing) -> Tensor:
        """x [T, H] -> sum_k weights[t, k] * expert_{experts[t, k]}(x[t]), [T, H] in x's dtype.

        On CPU in fp32, with the weights laid out by ``fuse_weights``, one call of the C kernel
        (``cpu_moe``); otherwise the torch paths below."""
        if cpu_moe.supports(x, self.gate_up_proj, self.down_proj):
            return cpu_moe.moe_experts_cpu(
                x, routing.experts, routing.weights, self.gate_up_proj, self.down_proj
            )
        num_tokens, top_k = routing.experts.shape
        flat = routing.experts.reshape(-1)  # [T*K]
        counts_t = torch.bincount(flat, minlength=self.num_experts)  # [E]
        if num_tokens <= PADDED_MAX_TOKENS:
            capacity = int(counts_t.max())
            if self.num_experts * capacity <= PADDED_WASTE * flat.shape[0]:
                return self._padded(x, routing, capacity)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        token_of = order // top_k  # [T*K] source token of each sorted assignment
        y_sorted = self._looped(x.index_select(0, token_of), counts_t.tolist())  # [T*K, H]
        # weighted in place when y_sorted is already fp32 (a temporary of ours): no second [T*K, H]
        weighted = y_sorted.float().mul_(routing.weights.reshape(-1).index_select(0, order)[:, None])
        out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, token_of, weighted)
        return out.to(x.dtype)

    def _looped(self, x_sorted: Tensor, counts: list[int]) -> Tensor:
        """One matmul pair per expert over its contiguous segment of the sorted rows."""
        y_sorted = torch.empty_like(x_sorted)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            seg = x_sorted[start : start + count]  # [c, H]
            gate, up = F.linear(seg, self.gate_up_proj[e]).chunk(2, dim=-1)  # [c, I] each
            y_sorted[start : start + count] = F.linear(F.silu(gate) * up, self.down_proj[e])
            start += count
        return y_sorted

    def _padded(self, x: Tensor, routing: Routing, capacity: int) -> Tensor:
        """All experts in two batched matmuls, each expert's rows padded to ``capacity``::

            assignments (t, k)   (0,0)->e2  (0,1)->e0  (1,0)->e2  (1,1)->e1 ...
            padded rows          | e0 . . | e1 . . | e2 e2 . | ...    row e * C + rank of the
                                                                     assignment among e's, in (t, k) order

        Padding rows are zero, computed, and never read back. The K outputs of a token are summed
        in fp32 after weighting (for K = 2 bit-identical to accumulating them one by one).
        """
        num_tokens, top_k = routing.experts.shape
        flat = routing.experts.reshape(-1)  # [T*K]
        onehot = F.one_hot(flat, self.num_experts)  # [T*K, E]
        rank = (onehot.cumsum(0) * onehot).sum(1) - 1  # [T*K] earlier assignments to the same expert
        dest = flat * capacity + rank  # [T*K]
        x_pad = x.new_zeros(self.num_experts * capacity, x.shape[1])
        x_pad.index_copy_(0, dest, x.repeat_interleave(top_k, dim=0))
        x_pad = x_pad.view(self.num_experts, capacity, -1)  # [E, C, H]
        gate, up = torch.bmm(x_pad, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, C, I]
        y_pad = torch.bmm(F.silu(gate) * up, self.down_proj.transpose(1, 2))  # [E, C, H]
        y = y_pad.view(self.num_experts * capacity, -1).index_select(0, dest)  # [T*K, H]
        weighted = y.view(num_tokens, top_k, -1).float() * routing.weights[:, :, None]
        return weighted.sum(1).to(x.dtype)


class SparseMoE(nn.Module):
    """Router + grouped experts (MiMo-V2-Flash has no shared experts)."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = GroupedExperts(
            config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.experts(x, self.gate(x))
