"""Non-causal GQA attention within packed segments, optionally limited to a band and with sinks.

Contract (both paths): q [N, Hq, D], k and v [N, Hkv, D] (Hq a multiple of Hkv; query head h reads
kv head h // (Hq / Hkv)), segments packed back to back (``Segments``); the result is [N, Hq, D]
where query i of a segment sees key j of the same segment when ``|i - j| <= band`` (positions
inside the segment; ``band=None``: every key of the segment), softmax scale 1/sqrt(D).

Sinks (the MiMo ViT's ``attn.sinks``, one scalar per query head) follow the checkpoint's own code
(R1, transcribing ``modeling_mimo_v2.py``): a bias added to the logit of key 0 of each segment
after the band mask, so it shifts only the queries that see key 0 (the first band + 1). It is not
the gpt-oss "extra logit with V = 0" that sglang's FA3 ``s_aux`` and ggml's soft_max sinks apply.

- torch (CPU, and the fallback): equal-length segments run together ([B, H, L, D] views when they
  are back to back, gathers otherwise). Banded blocks walk the queries in blocks of ``block`` and
  attend each block to the only keys its band reaches, so the cost is O(N * (block + 2 * band)),
  never a dense N x N mask:

      segment positions  0 ........................................... L-1
      query block            [q0, q1)
      reachable keys     [q0 - band, q1 + band)   (clipped to [0, L)); mask |i - j| <= band in it

- triton (CUDA; TRITON_INTERPRET=1 in tests): one flash-attention kernel that skips the key tiles
  outside the band (``encoder/kernels/triton_band.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from encoder.kernels.attention import AttnBackend, resolve_backend
from encoder.kernels.segments import Segments

DEFAULT_QUERY_BLOCK = 128


def _sink_bias(sinks: torch.Tensor, keys: int, dtype: torch.dtype) -> torch.Tensor:
    """[Hq, 1, keys]: the per-head sink on key 0, zero elsewhere (broadcast over queries)."""
    bias = torch.zeros(sinks.shape[0], 1, keys, dtype=dtype, device=sinks.device)
    bias[:, 0, 0] = sinks.to(dtype)
    return bias


def _band_mask(
    q0: int, q1: int, k0: int, k1: int, band: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[q1 - q0, k1 - k0] additive mask: 0 where |i - j| <= band, -inf elsewhere."""
    qi = torch.arange(q0, q1, device=device)[:, None]
    kj = torch.arange(k0, k1, device=device)[None, :]
    mask = torch.zeros((q1 - q0, k1 - k0), dtype=dtype, device=device)
    return mask.masked_fill_((qi - kj).abs() > band, float("-inf"))


def _segments_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    band: int | None,
    sinks: torch.Tensor | None,
    block: int,
) -> torch.Tensor:
    """B equal-length segments: q [B, Hq, L, D], k/v [B, Hkv, L, D] -> [B, Hq, L, D]."""
    length = q.shape[2]
    if band is None or band >= length - 1:  # the band reaches every key: one call
        mask = None if sinks is None else _sink_bias(sinks, length, q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out = torch.empty_like(q)
    for q0 in range(0, length, block):
        q1 = min(length, q0 + block)
        k0, k1 = max(0, q0 - band), min(length, q1 + band)
        mask = _band_mask(q0, q1, k0, k1, band, q.dtype, q.device)  # [b, kk]
        if sinks is not None and k0 == 0:
            mask = mask + _sink_bias(sinks, k1 - k0, q.dtype)  # [Hq, b, kk]; -inf stays -inf
        out[:, :, q0:q1] = F.scaled_dot_product_attention(
            q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], attn_mask=mask, enable_gqa=True
        )
    return out


def band_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seg: Segments,
    band: int | None,
    sinks: torch.Tensor | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """The torch path: per length bucket, per query block (``block`` queries, default
    ``DEFAULT_QUERY_BLOCK``; one longer than a segment gives one dense masked call). [N, H*, D] -> [N, Hq, D]."""
    block = DEFAULT_QUERY_BLOCK if block is None else block
    n, hq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv or k.shape != v.shape or k.shape[0] != n:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not GQA-shaped")
    out = torch.empty_like(q)
    for bucket in seg.buckets:
        b, length = bucket.positions.shape
        if bucket.start is not None:  # back-to-back segments: views, no gather
            rows = slice(bucket.start, bucket.start + b * length)
            qb, kb, vb = (x[rows].view(b, length, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
            out[rows].view(b, length, hq, d).copy_(
                _segments_attention(qb, kb, vb, band, sinks, block).transpose(1, 2)
            )
        else:
            qb, kb, vb = (x[bucket.positions].transpose(1, 2) for x in (q, k, v))  # [B, H*, L, D]
            out[bucket.positions] = _segments_attention(qb, kb, vb, band, sinks, block).transpose(1, 2)
    return out


def band_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seg: Segments,
    band: int | None,
    sinks: torch.Tensor | None = None,
    backend: AttnBackend = "auto",
) -> torch.Tensor:
    """Banded (or, with ``band=None``, full) GQA attention within each segment of ``seg``."""
    if resolve_backend(backend, q.device, q.shape[-1]) == "triton":
        from encoder.kernels.triton_band import band_attention_triton

        return band_attention_triton(q, k, v, seg.cu_seqlens, seg.max_len, band, sinks)
    return band_attention_torch(q, k, v, seg, band, sinks)
