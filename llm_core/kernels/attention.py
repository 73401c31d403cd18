"""Paged attention over the KV pools: causal, optional sliding window, optional learned sinks,
GQA, and a value head dim that differs from the q/k head dim.

Semantics (identical in every backend):

    score(q at pos p, key at pos j) = (q . k_j) * scale       for max(0, p - W + 1) <= j <= p
    probs = softmax([scores..., sink_h])[:-1]                  the sink is a per-head logit with no
    out   = probs @ V                                          value: it only absorbs probability mass

``W`` (``window``) counts the query itself; None means full causal attention. Query head h reads KV
head ``h // (H // Hkv)``.

Backends, chosen by :func:`paged_attention`:

    "triton"  the Triton kernels in ``triton_attention`` (prefill: varlen queries; decode: one
              query per sequence); CUDA tensors
    "cpu"     the C kernel of ``cpu_attention`` (prefill and decode in one call, straight from the
              pools); fp32 CPU tensors, when the extension is built
    "torch"   :func:`paged_attention_torch` (gathers each sequence's pages and runs a masked softmax
              in fp32) and :func:`paged_decode_torch` (the same, batched over single-token
              sequences): the reference, and the fallback for anything else

All return [T, H, Dv] in q's dtype and agree to float32 rounding. The models reach these through
``llm_core.backends.attention``, which names the kernel explicitly (chosen once per engine); the
device-based default of ``paged_attention`` serves direct callers (tests, benchmarks).
"""

from __future__ import annotations

import torch
from torch import Tensor

from llm_core.kernels import cpu_attention


def write_kv(k_cache: Tensor, v_cache: Tensor, slots: Tensor, k: Tensor, v: Tensor) -> None:
    """Store new tokens' k [T, Hkv, D] and v [T, Hkv, Dv] at flat ``slots`` [T] of the paged pools
    k_cache [N, page, Hkv, D] / v_cache [N, page, Hkv, Dv] (viewed as [N * page, Hkv, *])."""
    assert slots.shape[0] == k.shape[0] == v.shape[0]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [N*page, Hkv, D]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])  # [N*page, Hkv, Dv]
    k_flat.index_copy_(0, slots, k.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, v.to(v_cache.dtype))


def masked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    scale: float,
    window: int | None,
    sinks: Tensor | None,
) -> Tensor:
    """Dense reference attention for one sequence.

    q [n, H, D], k [m, Hkv, D], v [m, Hkv, Dv], q_pos [n], k_pos [m] (absolute positions; the mask is
    built from them, so k may start anywhere). sinks [H] or None. Returns [n, H, Dv] in q's dtype.
    Every query must see at least one key or a sink (true for causal self-attention).
    """
    n, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    qf = q.float().view(n, num_kv, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    kf = k.float().permute(1, 2, 0)[:, None]  # [Hkv, 1, D, m]
    vf = v.float().permute(1, 0, 2)[:, None]  # [Hkv, 1, m, Dv]
    scores = torch.matmul(qf, kf) * scale  # [Hkv, G, n, m]
    allowed = k_pos[None, :] <= q_pos[:, None]  # [n, m]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink_col = sinks.float().view(num_kv, group, 1, 1).expand(num_kv, group, n, 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf)  # [Hkv, G, n, Dv]
    return out.permute(2, 0, 1, 3).reshape(n, num_heads, -1).to(q.dtype)


def paged_attention_torch(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    cu_seqlens_q: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int | None = None,
    sinks: Tensor | None = None,
    q_block: int = 256,
) -> Tensor:
    """Torch paged attention: q [T, H, D] packed by ``cu_seqlens_q`` -> out [T, H, Dv].

    Each sequence's queries are processed in blocks of ``q_block`` rows (bounding the score
    tensor at [H, q_block, keys]); a block reads only the pages holding keys it can see:

        positions  kv_start (= q_first - W + 1, or 0)        q_first        q_last
                   |<------- keys read (whole pages) ------->|<-- block -->|
        pages      p0 = kv_start // page   ...   p1 - 1 = q_last // page

    so SWA pages that left the window (-1 in the table) are never touched.
    """
    page_size = k_cache.shape[1]
    num_heads = q.shape[1]
    out = q.new_empty(q.shape[0], num_heads, v_cache.shape[-1])
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        lo, hi = cu[b], cu[b + 1]
        first_q = seq_len - (hi - lo)
        for q_first in range(first_q, seq_len, q_block):
            q_end = min(q_first + q_block, seq_len)  # queries at q_first .. q_end - 1
            kv_start = 0 if window is None else max(0, q_first - window + 1)
            p0, p1 = kv_start // page_size, (q_end - 1) // page_size + 1
            phys = page_table[b, p0:p1].to(torch.int64)
            assert bool((phys >= 0).all()), f"sequence {b}: a page in [{p0}, {p1}) is not resident"
            # Slice to exactly [kv_start, q_end): later slots are causally masked or stale.
            a, z = kv_start - p0 * page_size, q_end - p0 * page_size
            k_b = k_cache[phys].flatten(0, 1)[a:z]  # [m, Hkv, D]
            v_b = v_cache[phys].flatten(0, 1)[a:z]  # [m, Hkv, Dv]
            k_pos = torch.arange(kv_start, q_end, device=q.device)
            q_pos = torch.arange(q_first, q_end, device=q.device)
            rows = slice(lo + q_first - first_q, lo + q_end - first_q)
            out[rows] = masked_attention(q[rows], k_b, v_b, q_pos, k_pos, scale, window, sinks)
    return out


def paged_decode_torch(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Torch decode, batched over sequences: q [B, H, D] (query b at seq_lens[b] - 1) -> [B, H, Dv].

    Every sequence reads the same number P of pages starting at its first needed page; shorter
    ones are padded with page 0 and masked, so the whole step is a few batched ops:

        seq b:  logical pages p0_b .. p0_b + P - 1     (p0_b = kv_start_b // page)
                keys allowed: kv_start_b <= pos <= seq_len_b - 1
    """
    page_size = k_cache.shape[1]
    num_seqs, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[2]
    group = num_heads // num_kv
    q_pos = seq_lens.to(torch.int64) - 1  # [B]
    kv_start = torch.zeros_like(q_pos) if window is None else (q_pos - window + 1).clamp(min=0)
    p0 = kv_start // page_size  # [B]
    last_page = q_pos // page_size  # [B]
    num_pages = int((last_page - p0).max()) + 1
    logical = p0[:, None] + torch.arange(num_pages, device=q.device)[None, :]  # [B, P]
    in_range = logical <= last_page[:, None]
    phys = page_table.to(torch.int64).gather(1, torch.minimum(logical, last_page[:, None]))
    assert bool((phys[in_range] >= 0).all()), "a page inside some query's window is not resident"
    phys = torch.where(in_range, phys, 0)
    k = k_cache[phys].flatten(1, 2).float()  # [B, P*page, Hkv, D]
    v = v_cache[phys].flatten(1, 2).float()  # [B, P*page, Hkv, Dv]
    k_pos = (logical[:, :, None] * page_size + torch.arange(page_size, device=q.device)).flatten(1)  # [B, M]
    allowed = (k_pos >= kv_start[:, None]) & (k_pos <= q_pos[:, None])  # [B, M]
    # Padding and stale slots may hold anything, even NaN. Their scores are overwritten with -inf
    # below; their values must be zeroed too, since 0-probability * NaN would still be NaN.
    v = v.masked_fill(~allowed[:, :, None, None], 0.0)
    qf = q.float().view(num_seqs, num_kv, group, head_dim)
    scores = torch.einsum("bhgd,bmhd->bhgm", qf, k) * scale  # [B, Hkv, G, M]
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink_col = sinks.float().view(1, num_kv, group, 1).expand(num_seqs, num_kv, group, 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgm,bmhe->bhge", probs, v)  # [B, Hkv, G, Dv]
    return out.reshape(num_seqs, num_heads, -1).to(q.dtype)


def paged_attention(
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
    backend: str | None = None,
) -> Tensor:
    """Attention of packed queries q [T, H, D] over paged KV -> [T, H, Dv].

    ``backend``: "triton", "cpu", "torch", or None (Triton on CUDA; on CPU the C kernel when it is
    built and the tensors are fp32, else torch). With Triton, a batch of single-token queries
    (``max_seqlen_q == 1``) uses the decode kernel, anything else the prefill one.
    """
    if backend is None:
        if q.is_cuda:
            backend = "triton"
        else:
            backend = "cpu" if cpu_attention.supports(q, k_cache, v_cache) else "torch"
    if backend == "cpu":
        return cpu_attention.paged_attention_cpu(
            q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, scale, window, sinks
        )
    if backend == "torch":
        if max_seqlen_q == 1 and q.shape[0] == seq_lens.shape[0]:
            return paged_decode_torch(q, k_cache, v_cache, page_table, seq_lens, scale, window, sinks)
        return paged_attention_torch(
            q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, scale, window, sinks
        )
    assert backend == "triton", backend
    from llm_core.kernels import triton_attention

    if max_seqlen_q == 1:
        return triton_attention.paged_decode(q, k_cache, v_cache, page_table, seq_lens, scale, window, sinks)
    return triton_attention.paged_prefill(
        q, k_cache, v_cache, page_table, cu_seqlens_q, seq_lens, max_seqlen_q, scale, window, sinks
    )
