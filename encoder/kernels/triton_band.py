"""Triton flash attention over packed segments with a band window, key-0 sinks and GQA (MiMo ViT).

Same contract as ``band_attention.band_attention_torch``: q [N, Hq, D], k/v [N, Hkv, D] packed
segment after segment (``cu_seqlens``); query i of a segment sees key j of it when |i - j| <= band
(``band=None``: all of it); ``sinks`` [Hq] is added to key 0's logit after the band mask (the
checkpoint's own semantics, see band_attention.py). Runs on CUDA; on CPU under TRITON_INTERPRET=1.

One program per (segment, query head, block of BLOCK_M queries). It walks only the key tiles the
band can reach, so the work per program is O(BLOCK_M * (BLOCK_M + 2 * band)) whatever the length:

    queries  m0 .. m0 + BLOCK_M - 1
    keys     max(0, m0 - band) rounded down to a tile .. min(L, m0 + BLOCK_M + band)   (BLOCK_N steps)

Masked entries are -inf; a query row whose first tiles are all masked keeps a -inf running max,
which the update guards (no inf - inf). fp32 inputs use IEEE dots (agrees with torch to ~1e-6).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from encoder.kernels.triton_segments import segment_operands


@triton.jit
def _band_attn_kernel(  # type: ignore[no-untyped-def]  # params are typed by the Triton JIT
    Q,
    K,
    V,
    Out,
    Sinks,
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
    GROUPS: tl.constexpr,  # query heads per kv head
    BAND: tl.constexpr,  # -1: no band
    HAS_SINKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    kv_head = head // GROUPS
    start = tl.load(CuSeqlens + seg).to(tl.int64)
    seqlen = tl.load(CuSeqlens + seg + 1).to(tl.int64) - start
    m0 = m_block.to(tl.int64) * BLOCK_M  # int64 like seqlen: the key loop's bounds share a type
    if m0 >= seqlen:
        return

    offs_m = m0 + tl.arange(0, BLOCK_M)  # query positions within the segment
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < seqlen
    mask_d = offs_d < HEAD_DIM
    q_ptrs = Q + (start + offs_m)[:, None] * stride_qn + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [M, D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # fold log2(e): exp2 is the cheap instruction
    if HAS_SINKS:
        sink = tl.load(Sinks + head).to(tl.float32) * 1.4426950408889634

    if BAND >= 0:
        lo = (tl.maximum(m0 - BAND, 0) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(seqlen, m0 + BLOCK_M + BAND)
    else:
        lo = 0
        hi = seqlen
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < seqlen
        k_ptrs = K + (start + offs_n)[None, :] * stride_kn + kv_head * stride_kh + offs_d[:, None]
        k = tl.load(k_ptrs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)  # [D, N]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [M, N], log2 units
        if HAS_SINKS:
            s = s + tl.where(offs_n == 0, sink, 0.0)[None, :]
        visible = mask_n[None, :]
        if BAND >= 0:
            dist = offs_m[:, None] - offs_n[None, :]
            visible = visible & (dist <= BAND) & (dist >= -BAND)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = V + (start + offs_n)[:, None] * stride_vn + kv_head * stride_vh + offs_d[None, :]
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # Every real query sees itself (l_i > 0); padded rows past the segment (not stored) divide by 1.
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = Out + (start + offs_m)[:, None] * stride_on + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def band_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    band: int | None,
    sinks: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Banded GQA attention within each segment; q [N, Hq, D], k/v [N, Hkv, D] (last dim contiguous
    is best). ``cu_seqlens`` [S + 1] int32 on q's device; ``max_seqlen`` sizes the grid."""
    assert q.dim() == 3 and k.shape == v.shape and k.shape[0] == q.shape[0], (
        f"q/k/v shapes {q.shape} {k.shape} {v.shape}"
    )
    assert q.shape[1] % k.shape[1] == 0 and q.shape[2] == k.shape[2], "GQA needs Hq % Hkv == 0, equal D"
    ops = segment_operands(q, k, v, cu_seqlens)
    heads = q.shape[1]
    if q.shape[0] == 0:
        return ops.out
    if sinks is not None:
        assert sinks.shape == (heads,), f"sinks shape {tuple(sinks.shape)}, expected ({heads},)"
        sinks = sinks.contiguous()
    _band_attn_kernel[ops.grid(max_seqlen, block_m)](
        *ops.args(sinks if sinks is not None else ops.q),  # Sinks is unread without sinks
        GROUPS=heads // k.shape[1],
        BAND=-1 if band is None else int(band),
        HAS_SINKS=sinks is not None,
        **ops.tile_constants(block_m, block_n),
    )
    return ops.out
