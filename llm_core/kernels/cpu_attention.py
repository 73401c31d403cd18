"""CPU paged attention through the C kernel (``_paged_attention.c``): varlen prefill and decode in one
call, reading keys and values straight from the pools through the page table.

Same semantics and signature as ``attention.paged_attention_torch`` (which stays the reference):

    q [T, H, D] packed by cu_seqlens_q, pools k [N, page, Hkv, D] / v [N, page, Hkv, Dv]
    -> out [T, H, Dv]        query at position p sees keys max(0, p - W + 1) .. p, plus the sink

Why a kernel: on CPU the torch path spends a decode step on gathers, masks and small batched
matmuls over score tensors, and a prefill step on per-block ops; the kernel touches each key and
value once per query (per block of keys, in cache) and never builds a score tensor. fp32 only;
``AVAILABLE`` is False when the extension was not built (no C compiler), and ``backends.selector``
chooses the torch attention backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llm_core.kernels import c_kernel
from llm_core.kernels.c_kernel import buffer as _buf

_kernel = c_kernel.load("llm_core.kernels._paged_attention")

AVAILABLE = _kernel is not None


def simd() -> str | None:
    """'avx2' or 'scalar' (the primitives the kernel uses), None when not built."""
    return c_kernel.simd(_kernel)


def set_simd(name: str) -> None:
    """Use the 'avx2' or the 'scalar' primitives from now on (see ``c_kernel.set_simd``)."""
    c_kernel.set_simd(_kernel, name)


def supports(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """True when the kernel can run these tensors (built, CPU, fp32)."""
    return (
        _kernel is not None
        and q.device.type == k_cache.device.type == v_cache.device.type == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
    )


def _pool_args(
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    sinks: Tensor | None,
    out: Tensor,
    scale: float,
    window: int | None,
) -> tuple[object, ...]:
    """What both kernel entries take after their queries: the pools (in place: the fused entry
    writes them; the kernel rejects non-contiguous ones), the batch, the sinks, out [T, H, Dv] and
    the sizes."""
    page_size, num_kv, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    return (
        k_cache.numpy(),
        v_cache.numpy(),
        _buf(page_table.to(torch.int32)),
        _buf(cu_seqlens_q.to(torch.int32)),
        _buf(seq_lens.to(torch.int32)),
        b"" if sinks is None else _buf(sinks.to(torch.float32)),
        out.numpy(),
        out.shape[1],
        num_kv,
        head_dim,
        v_cache.shape[-1],
        page_size,
        0 if window is None else int(window),
        float(scale),
    )


def paged_attention_cpu(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention of packed queries q [T, H, D] over paged fp32 pools -> [T, H, Dv] (see module doc).

    Raises ValueError (from the kernel) when a page a query reads is not in the pool, and
    RuntimeError when the kernel is not built or the tensors are not CPU fp32."""
    if _kernel is None:
        raise RuntimeError(
            "llm_core.kernels._paged_attention is not built; use attention.paged_attention_torch"
        )
    if not supports(q, k_cache, v_cache):
        raise RuntimeError(f"the CPU kernel takes fp32 CPU tensors, got {q.dtype} on {q.device}")
    assert k_cache.shape[3] == q.shape[2], (k_cache.shape, q.shape)
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    _kernel.paged_attention(
        _buf(q), *_pool_args(k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, sinks, out, scale, window)
    )
    return out


def qkv_attention_cpu(
    qkv: Tensor,
    cos: Tensor,
    sin: Tensor,
    slots: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    num_heads: int,
    scale: float,
    window: int | None = None,
    sinks: Tensor | None = None,
    v_scale: float = 1.0,
) -> Tensor:
    """The attention layer between its two projections, in one kernel call -> out [T, H, Dv]:

        qkv [T, (H + Hkv) * D + Hkv * Dv]   rows [ q heads | k heads | v heads ] (the fused projection)
        -> rotate the first ``cos.shape[1]`` dims of every q and k head (cos/sin [T, width]; in place)
        -> store k and ``v_scale`` * v at ``slots`` [T] of the pools (what ``attention.write_kv`` does)
        -> attention of the rotated q heads, as ``paged_attention_cpu``

    Same results as ``rope.apply_partial_rotary_`` + ``write_kv`` + ``paged_attention_cpu`` (the
    pools get the same bits). ``qkv`` must be contiguous: it is rotated in place. Raises ValueError
    for a write slot outside the pool (checked before anything is written) and for a page a query
    reads that is not in the pool (checked for the whole batch before any KV is stored: the pools
    are then as they were)."""
    if _kernel is None:
        raise RuntimeError("llm_core.kernels._paged_attention is not built; use the torch path")
    if not supports(qkv, k_cache, v_cache) or not qkv.is_contiguous():
        raise RuntimeError(
            f"the CPU kernel takes contiguous fp32 CPU tensors, got {qkv.dtype} on {qkv.device}"
        )
    num_kv, head_dim, v_dim = k_cache.shape[2], k_cache.shape[3], v_cache.shape[-1]
    assert qkv.shape[1] == (num_heads + num_kv) * head_dim + num_kv * v_dim, (qkv.shape, k_cache.shape)
    out = qkv.new_empty(qkv.shape[0], num_heads, v_dim)
    _kernel.qkv_attention(
        qkv.numpy(),
        _buf(cos),
        _buf(sin),
        _buf(slots.to(torch.int64)),
        *_pool_args(k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, sinks, out, scale, window),
        float(v_scale),
    )
    return out
