"""Non-causal attention over packed variable-length segments (``cu_seqlens``).

Two paths with one contract: q, k, v are [N, H, D] (segments packed back to back), the result is
[N, H, D] where token i attends only to tokens of its own segment.

- torch (CPU, and the fallback): segments of equal length are gathered into one [B, H, L, D]
  batch and run through SDPA, so a 448x448 image's 16 equal windows cost one call rather than
  16, while memory stays O(B * L * D) per call (no N x N block-diagonal mask):

      segments:  [ 64 | 64 | 32 | 64 | 32 | 16 ]      (starts 0, 64, 128, 160, 224, 256)
      buckets:   L=16: [256]   L=32: [128, 224]   L=64: [0, 64, 160]
                 each bucket -> rows starts[:, None] + arange(L) -> one SDPA of [B, H, L, D];
                 a bucket whose segments are back to back is a plain view (no gather).
- triton (CUDA): one flash-attention kernel over all segments (``encoder/kernels/triton_varlen.py``).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from encoder.kernels.segments import Segments

AttnBackend = Literal["auto", "torch", "triton"]


def resolve_backend(backend: AttnBackend, device: torch.device, head_dim: int) -> AttnBackend:
    """ "auto" -> "triton" on CUDA for head dims up to 256 (the Triton kernels' limit), "torch"
    otherwise; a named backend as it is. A model resolves its backend once at load
    (``PackedTower.resolve_attention``, ``MiMoAudioEncoder.resolve_attention``); the kernels apply
    the same rule to a direct caller's "auto"."""
    if backend != "auto":
        return backend
    return "triton" if device.type == "cuda" and head_dim <= 256 else "torch"


def varlen_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Per-length-bucket SDPA. q, k, v: [N, H, D] -> [N, H, D]."""
    n, h, d = q.shape
    out: torch.Tensor | None = None
    for bucket in seg.buckets:
        b, length = bucket.positions.shape
        if bucket.start is not None:  # back-to-back segments: a view, no gather
            rows = slice(bucket.start, bucket.start + b * length)
            qb, kb, vb = (x[rows].view(b, length, h, d).transpose(1, 2) for x in (q, k, v))  # [B, H, L, D]
        else:
            qb, kb, vb = (x[bucket.positions].transpose(1, 2) for x in (q, k, v))
        ob = F.scaled_dot_product_attention(qb, kb, vb).transpose(1, 2)  # [B, L, H, D]
        if len(seg.buckets) == 1:
            return ob.reshape(n, h, d)
        if out is None:
            out = torch.empty_like(q)
        if bucket.start is not None:
            out[rows] = ob.reshape(b * length, h, d)
        else:
            out[bucket.positions] = ob
    assert out is not None, "segments cover at least one token"
    return out


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments, backend: AttnBackend = "auto"
) -> torch.Tensor:
    """Attention within each segment of ``seg``; softmax scale 1/sqrt(D). [N, H, D] -> [N, H, D]."""
    if resolve_backend(backend, q.device, q.shape[-1]) == "triton":
        from encoder.kernels.triton_varlen import varlen_attention_triton

        return varlen_attention_triton(q, k, v, seg.cu_seqlens, seg.max_len)
    return varlen_attention_torch(q, k, v, seg)
