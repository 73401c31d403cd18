"""Triton flash attention over packed variable-length segments (non-causal), for the vision tower.

Same contract as ``attention.varlen_attention_torch``: q, k, v [N, H, D] packed segment after
segment (boundaries in ``cu_seqlens``), output [N, H, D], each token attending to its own segment.
Runs on CUDA; on CPU it runs under TRITON_INTERPRET=1, which is how the tests check it.

One program per (segment, head, block of BLOCK_M queries); it walks the segment's keys in blocks
of BLOCK_N with an online softmax, so memory is O(BLOCK_M * D) per program whatever the length:

    cu_seqlens: 0        s1             s2        N
    tokens:     [ seg 0  | seg 1         | seg 2   ]
    program (seg=1, m=j) queries s1 + j*BLOCK_M .. s1 + (j+1)*BLOCK_M - 1   (masked at s2)
                         keys    s1 .. s2 - 1 in BLOCK_N steps                (masked at s2)

Programs whose query block starts past their segment's end exit at once (the grid is sized by
the longest segment). Head dims that are not powers of two are padded and masked. fp32 inputs use
IEEE dots so the kernel agrees with the torch path to ~1e-6.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from encoder.kernels.triton_segments import segment_operands


@triton.jit
def _varlen_attn_kernel(  # type: ignore[no-untyped-def]  # params are typed by the Triton JIT
    Q,
    K,
    V,
    Out,
    CuSeqlens,
    sm_scale,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_on,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    start = tl.load(CuSeqlens + seg).to(tl.int64)
    seqlen = tl.load(CuSeqlens + seg + 1).to(tl.int64) - start
    if m_block * BLOCK_M >= seqlen:
        return

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows within the segment
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seqlen
    mask_d = offs_d < HEAD_DIM
    q_ptrs = Q + (start + offs_m)[:, None] * stride_qn + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [M, D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # fold log2(e): exp2 is the cheap instruction

    for n0 in range(0, seqlen, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < seqlen
        k_ptrs = K + (start + offs_n)[None, :] * stride_kn + head * stride_kh + offs_d[:, None]
        k = tl.load(k_ptrs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # [D, N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        # Every block holds at least one unmasked key (n0 < seqlen), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = V + (start + offs_n)[:, None] * stride_vn + head * stride_vh + offs_d[None, :]
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    o_ptrs = Out + (start + offs_m)[:, None] * stride_on + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def varlen_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Attention within each segment; q, k, v [N, H, D] (any strides, last dim contiguous is best).

    ``cu_seqlens`` [S + 1] int32 on q's device; ``max_seqlen`` the longest segment (sizes the grid).
    """
    assert q.shape == k.shape == v.shape and q.dim() == 3, f"q/k/v shapes {q.shape} {k.shape} {v.shape}"
    ops = segment_operands(q, k, v, cu_seqlens)
    if q.shape[0] == 0:
        return ops.out
    _varlen_attn_kernel[ops.grid(max_seqlen, block_m)](*ops.args(), **ops.tile_constants(block_m, block_n))
    return ops.out
