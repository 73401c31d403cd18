"""The torch MoE backend: the reference router and grouped experts (any device, any dtype).

Experts are computed grouped: the T*K (token, expert) assignments are sorted by expert, each
expert runs one matmul over its contiguous segment, and results are scattered back with the
routing weights (a loop over experts, never over tokens). Small batches (decode) pad every
expert's segment to the largest one and run all experts in two ``bmm`` calls instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from llm_core.backends.moe import MoEBackend, Routing
from llm_core.backends.specs import RoutingSpec

# Batches of at most PADDED_MAX_TOKENS tokens (decode steps) run the experts as two padded batched
# matmuls, as long as the padded rows (E * largest expert count) stay within PADDED_WASTE times the
# real (token, expert) assignments; otherwise (prefill) one matmul pair per expert, which is cheaper
# once segments are long (measured on bench.llm: padded is ~7% faster in decode, ~7% slower in prefill).
PADDED_MAX_TOKENS = 64
PADDED_WASTE = 3


class TorchMoE(MoEBackend):
    name = "torch"

    def route(self, x: Tensor, weight: Tensor, bias: Tensor, spec: RoutingSpec) -> Routing:
        scores = F.linear(x.float(), weight.float()).sigmoid()  # [T, E]
        choice = scores + bias
        if spec.topk_group < spec.n_group:
            per_group = spec.num_experts // spec.n_group
            grouped = choice.view(-1, spec.n_group, per_group)  # [T, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = group_scores.topk(spec.topk_group, dim=-1).indices  # [T, topk_group]
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)  # [T, G]
            choice = grouped.masked_fill(dropped[:, :, None], float("-inf")).view_as(choice)
        experts = choice.topk(spec.top_k, dim=-1).indices  # [T, K]
        weights = scores.gather(1, experts)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if spec.scaling != 1.0:  # x * 1.0 == x: skip the op
            weights = weights * spec.scaling
        return Routing(experts, weights)

    def experts(self, x: Tensor, routing: Routing, gate_up: Tensor, down: Tensor) -> Tensor:
        num_experts = gate_up.shape[0]
        num_tokens, top_k = routing.experts.shape
        flat = routing.experts.reshape(-1)  # [T*K]
        counts_t = torch.bincount(flat, minlength=num_experts)  # [E]
        if num_tokens <= PADDED_MAX_TOKENS:
            capacity = int(counts_t.max())
            if num_experts * capacity <= PADDED_WASTE * flat.shape[0]:
                return _padded(x, routing, gate_up, down, capacity)
        order = torch.argsort(flat, stable=True)  # assignments grouped by expert
        token_of = order // top_k  # [T*K] source token of each sorted assignment
        y_sorted = _looped(x.index_select(0, token_of), counts_t.tolist(), gate_up, down)  # [T*K, H]
        # weighted in place when y_sorted is already fp32 (a temporary of ours): no second [T*K, H]
        weighted = y_sorted.float().mul_(routing.weights.reshape(-1).index_select(0, order)[:, None])
        out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, token_of, weighted)
        return out.to(x.dtype)


def _looped(x_sorted: Tensor, counts: list[int], gate_up: Tensor, down: Tensor) -> Tensor:
    """One matmul pair per expert over its contiguous segment of the sorted rows."""
    y_sorted = torch.empty_like(x_sorted)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        seg = x_sorted[start : start + count]  # [c, H]
        gate, up = F.linear(seg, gate_up[e]).chunk(2, dim=-1)  # [c, I] each
        y_sorted[start : start + count] = F.linear(F.silu(gate) * up, down[e])
        start += count
    return y_sorted


def _padded(x: Tensor, routing: Routing, gate_up: Tensor, down: Tensor, capacity: int) -> Tensor:
    """All experts in two batched matmuls, each expert's rows padded to ``capacity``::

        assignments (t, k)   (0,0)->e2  (0,1)->e0  (1,0)->e2  (1,1)->e1 ...
        padded rows          | e0 . . | e1 . . | e2 e2 . | ...    row e * C + rank of the
                                                                 assignment among e's, in (t, k) order

    Padding rows are zero, computed, and never read back. The K outputs of a token are summed
    in fp32 after weighting (for K = 2 bit-identical to accumulating them one by one).
    """
    num_experts = gate_up.shape[0]
    num_tokens, top_k = routing.experts.shape
    flat = routing.experts.reshape(-1)  # [T*K]
    onehot = F.one_hot(flat, num_experts)  # [T*K, E]
    rank = (onehot.cumsum(0) * onehot).sum(1) - 1  # [T*K] earlier assignments to the same expert
    dest = flat * capacity + rank  # [T*K]
    x_pad = x.new_zeros(num_experts * capacity, x.shape[1])
    x_pad.index_copy_(0, dest, x.repeat_interleave(top_k, dim=0))
    x_pad = x_pad.view(num_experts, capacity, -1)  # [E, C, H]
    gate, up = torch.bmm(x_pad, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, C, I]
    y_pad = torch.bmm(F.silu(gate) * up, down.transpose(1, 2))  # [E, C, H]
    y = y_pad.view(num_experts * capacity, -1).index_select(0, dest)  # [T*K, H]
    weighted = y.view(num_tokens, top_k, -1).float() * routing.weights[:, :, None]
    return weighted.sum(1).to(x.dtype)
