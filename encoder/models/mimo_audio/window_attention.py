"""Attention within packed segments with a flash-attention style (left, right) window and an
optional causal mask: the audio tokenizer's layers.

Contract: q, k, v [N, H, D] (segments back to back, ``Segments``) -> [N, H, D]; query i of a
segment sees key j of the same segment when ``i - left <= j <= i + right`` (a side of -1 is
unlimited) and, if ``causal``, ``j <= i``; softmax scale 1/sqrt(D).

A symmetric non-causal window (or none) is exactly ``band_attention``'s contract, so it goes there
(its Triton kernel on CUDA). Anything else runs per length bucket in torch: queries in blocks of
``block``, each against the only keys its window reaches, with a boolean mask for the rest:

    segment positions   0 ........................................ L-1
    query block             [q0, q1)
    reachable keys      [q0 - left, q1 + right)  (clipped to [0, L); causal: to q1)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from encoder.kernels.attention import AttnBackend
from encoder.kernels.band_attention import band_attention
from encoder.kernels.segments import Segments

QUERY_BLOCK = 256


def _window_mask(
    q0: int, q1: int, k0: int, k1: int, left: int, right: int, causal: bool, device: torch.device
) -> torch.Tensor:
    """[q1 - q0, k1 - k0] bool, True where the key is visible."""
    qi = torch.arange(q0, q1, device=device)[:, None]
    kj = torch.arange(k0, k1, device=device)[None, :]
    visible = torch.ones((q1 - q0, k1 - k0), dtype=torch.bool, device=device)
    if left >= 0:
        visible &= kj >= qi - left
    if right >= 0:
        visible &= kj <= qi + right
    if causal:
        visible &= kj <= qi
    return visible


def _bucket_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, left: int, right: int, causal: bool, block: int
) -> torch.Tensor:
    """B equal-length segments: q, k, v [B, H, L, D] -> [B, H, L, D]."""
    length = q.shape[2]
    out = torch.empty_like(q)
    for q0 in range(0, length, block):
        q1 = min(length, q0 + block)
        k0 = 0 if left < 0 else max(0, q0 - left)
        k1 = q1 if causal else (length if right < 0 else min(length, q1 + right))
        mask = _window_mask(q0, q1, k0, k1, left, right, causal, q.device)
        out[:, :, q0:q1] = F.scaled_dot_product_attention(
            q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], attn_mask=mask
        )
    return out


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seg: Segments,
    window: tuple[int, int],
    causal: bool,
    backend: AttnBackend = "auto",
    block: int = QUERY_BLOCK,
) -> torch.Tensor:
    """Windowed (or full) attention within each segment of ``seg``. [N, H, D] -> [N, H, D]."""
    left, right = window
    if not causal and left == right:
        return band_attention(q, k, v, seg, None if left < 0 else left, backend=backend)
    out = torch.empty_like(q)
    for bucket in seg.buckets:
        qb, kb, vb = (x[bucket.positions].transpose(1, 2) for x in (q, k, v))  # [B, H, L, D]
        out[bucket.positions] = _bucket_attention(qb, kb, vb, left, right, causal, block).transpose(1, 2)
    return out
