"""Triton paged attention kernels (prefill and decode) with sliding window, sinks and GQA.

Same semantics and output layout as ``attention.paged_attention_torch`` (the reference they are
tested against, under TRITON_INTERPRET=1 on CPU). Both kernels walk the KV one page at a time
(BLOCK_N = page_size, so a page-table lookup per block) with an online softmax. The sink enters as
the initial running state: a logit ``s_h`` with no value is exactly ``m = s_h, l = 1, acc = 0``.

    pages read by one query block (positions q_first .. q_last):
        window None:  pages 0 .. q_last // page
        window W:     pages max(0, q_first - W + 1) // page .. q_last // page
    per-element mask: j <= p  and  j > p - W  and  j < seq_len

The decode kernel tiles the query heads of one KV head (the GQA group) as rows, so each KV page is
read once per group.

Head dims need not be powers of two (MiMo uses 192/128): loads are padded to the next power of two
and masked. fp32 inputs use IEEE dots so the kernels agree with the torch path to ~1e-5.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _online_block(  # type: ignore[no-untyped-def]  # Triton kernel: params are typed by the JIT
    s,
    v,
    m_i,
    l_i,
    acc,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step: scores s [M, N] (masked = -inf), values v [N, Dv]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen only masked keys (and has no sink) keeps m = -inf; shift by 0 instead so
    # exp() gives 0 rather than NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_prefill_kernel(  # type: ignore[no-untyped-def]
    Q,
    K,
    V,
    Out,
    PageTable,
    CuQ,
    SeqLens,
    Sinks,
    sm_scale,
    window,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ko,
    stride_kh,
    stride_vp,
    stride_vo,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_pt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(CuQ + b)
    n_q = tl.load(CuQ + b + 1) - q_start
    seq_len = tl.load(SeqLens + b)
    first_pos = seq_len - n_q

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_q
    q_pos = first_pos + offs_m  # [M]
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, PAGE)
    q_ptrs = Q + (q_start + offs_m)[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)

    # Keys this block can see; an empty block (pid_m past n_q) gets an empty page range.
    blk_first = first_pos + pid_m * BLOCK_M
    blk_last = tl.minimum(blk_first + BLOCK_M, seq_len) - 1
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(blk_first - window + 1, 0)
    page_lo = kv_lo // PAGE
    page_hi = tl.where(blk_last >= blk_first, blk_last // PAGE + 1, page_lo)

    if HAS_SINKS:
        sink = tl.load(Sinks + h).to(tl.float32)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + 1.0
    else:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    for page in range(page_lo, page_hi):
        phys = tl.load(PageTable + b * stride_pt + page).to(tl.int64)
        k_pos = page * PAGE + offs_n  # [N]
        key_ok = k_pos < seq_len
        k = tl.load(
            K + phys * stride_kp + offs_n[:, None] * stride_ko + kvh * stride_kh + offs_d[None, :],
            mask=key_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
            other=0.0,
        )  # [N, D]
        v = tl.load(
            V + phys * stride_vp + offs_n[:, None] * stride_vo + kvh * stride_vh + offs_dv[None, :],
            mask=key_ok[:, None] & (offs_dv[None, :] < V_DIM),
            other=0.0,
        )  # [N, Dv]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale  # [M, N]
        allowed = (k_pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
        if HAS_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_i, l_i, acc = _online_block(s, v, m_i, l_i, acc, DOT_PRECISION)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = Out + (q_start + offs_m)[:, None].to(tl.int64) * stride_ot + h * stride_oh + offs_dv[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < V_DIM))


@triton.jit
def _paged_decode_kernel(  # type: ignore[no-untyped-def]
    Q,
    K,
    V,
    Out,
    PageTable,
    SeqLens,
    Sinks,
    sm_scale,
    window,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ko,
    stride_kh,
    stride_vp,
    stride_vo,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_pt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One program per (sequence, KV head): the GROUP query heads that share the KV head are the rows
    # of one tile (padded to BLOCK_H >= 16 for tl.dot), so each KV page is read once per group, not
    # once per query head. Decode is bound by those reads. All queries sit at position seq_len - 1.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(SeqLens + b)
    q_pos = seq_len - 1
    offs_g = tl.arange(0, BLOCK_H)
    head_ok = offs_g < GROUP
    heads = kvh * GROUP + offs_g  # [BLOCK_H] query heads of this group
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_n = tl.arange(0, PAGE)
    q = tl.load(
        Q + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=head_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )  # [H_blk, D]

    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(q_pos - window + 1, 0)
    if HAS_SINKS:
        m_i = tl.load(Sinks + heads, mask=head_ok, other=0.0).to(tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32) + 1.0
    else:
        m_i = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)

    for page in range(kv_lo // PAGE, q_pos // PAGE + 1):
        phys = tl.load(PageTable + b * stride_pt + page).to(tl.int64)
        k_pos = page * PAGE + offs_n
        key_ok = (k_pos <= q_pos) & (k_pos >= kv_lo)
        k = tl.load(
            K + phys * stride_kp + offs_n[:, None] * stride_ko + kvh * stride_kh + offs_d[None, :],
            mask=key_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
            other=0.0,
        )  # [N, D]
        v = tl.load(
            V + phys * stride_vp + offs_n[:, None] * stride_vo + kvh * stride_vh + offs_dv[None, :],
            mask=key_ok[:, None] & (offs_dv[None, :] < V_DIM),
            other=0.0,
        )  # [N, Dv]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale  # [H_blk, N]
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_i, l_i, acc = _online_block(s, v, m_i, l_i, acc, DOT_PRECISION)

    out = acc / l_i[:, None]  # l_i > 0: every query sees itself
    tl.store(
        Out + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=head_ok[:, None] & (offs_dv[None, :] < V_DIM),
    )


def _check(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Tensor) -> tuple[int, int]:
    assert q.dim() == 3 and k_cache.dim() == 4 and v_cache.dim() == 4
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert page_table.stride(-1) == 1
    page = k_cache.shape[1]
    assert page & (page - 1) == 0 and page >= 16, f"page_size {page} must be a power of two >= 16"
    num_heads, num_kv = q.shape[1], k_cache.shape[2]
    assert num_heads % num_kv == 0
    return page, num_heads // num_kv


def paged_prefill(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    max_seqlen_q: int,
    scale: float,
    window: int | None = None,
    sinks: Tensor | None = None,
    block_m: int = 32,
) -> Tensor:
    """Varlen paged attention: q [T, H, D] packed by ``cu_seqlens_q`` -> [T, H, Dv]."""
    page, group = _check(q, k_cache, v_cache, page_table)
    num_seqs, num_heads, head_dim = seq_lens.shape[0], q.shape[1], q.shape[2]
    v_dim = v_cache.shape[-1]
    out = torch.empty(q.shape[0], num_heads, v_dim, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, num_heads)
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        cu_seqlens_q,
        seq_lens,
        q if sinks is None else sinks,  # dummy pointer when there are no sinks
        scale,
        0 if window is None else window,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        V_DIM=v_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(v_dim),
        BLOCK_M=block_m,
        PAGE=page,
        HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


def paged_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """One query per sequence: q [B, H, D] (query b at position seq_lens[b] - 1) -> [B, H, Dv]."""
    page, group = _check(q, k_cache, v_cache, page_table)
    num_seqs, num_heads, head_dim = q.shape
    assert seq_lens.shape[0] == num_seqs
    v_dim = v_cache.shape[-1]
    out = torch.empty(num_seqs, num_heads, v_dim, dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    _paged_decode_kernel[(num_seqs, k_cache.shape[2])](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        seq_lens,
        q if sinks is None else sinks,
        scale,
        0 if window is None else window,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        page_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        V_DIM=v_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_DV=triton.next_power_of_2(v_dim),
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        PAGE=page,
        HAS_WINDOW=window is not None,
        HAS_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
