"""Packed attention segments: what the varlen attention kernels (``attention``, ``band_attention``,
``triton_varlen``) run over, whatever built the batch.

A packed batch is one token sequence cut into segments that attend only within themselves;
``Segments`` holds their boundaries (``cu_seqlens``) for the Triton path and, grouped by length,
their token positions for the CPU path. The vision layouts (``encoder.models.windows``,
``encoder.models.mimo_layout``) and the audio tokenizer build them; the kernels only read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class LengthBucket(NamedTuple):
    """The B segments of one length L. ``start`` is set when they are back to back in the sequence
    (rows [start, start + B*L)), so the CPU path can use a view instead of a gather."""

    length: int
    positions: torch.Tensor  # [B, L] long, token positions of each segment
    start: int | None


class Segments(NamedTuple):
    """Packed attention segments over the (reordered) token sequence.

    ``buckets`` groups segments of equal length for the CPU path (one SDPA call per bucket).
    """

    cu_seqlens: torch.Tensor  # [S + 1] int32, cu_seqlens[0] = 0, cu_seqlens[-1] = N
    lengths: tuple[int, ...]  # S segment lengths in tokens
    max_len: int
    buckets: tuple[LengthBucket, ...]

    def to(self, device: torch.device) -> Segments:
        return Segments(
            self.cu_seqlens.to(device, non_blocking=True),
            self.lengths,
            self.max_len,
            tuple(b._replace(positions=b.positions.to(device, non_blocking=True)) for b in self.buckets),
        )


def make_segments(lengths: Sequence[int]) -> Segments:
    """Segments from per-segment lengths (all > 0)."""
    assert lengths and min(lengths) > 0, f"segment lengths must be positive, got {list(lengths)[:8]}"
    lens = torch.tensor(list(lengths), dtype=torch.long)
    starts = torch.cumsum(lens, 0) - lens  # [S]
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0).to(torch.int32)
    buckets = []
    for n in sorted(set(lengths)):
        seg_starts = starts[lens == n]  # [B]
        first = int(seg_starts[0])
        back_to_back = torch.equal(seg_starts, first + n * torch.arange(len(seg_starts)))
        buckets.append(
            LengthBucket(n, seg_starts[:, None] + torch.arange(n), first if back_to_back else None)
        )
    return Segments(cu, tuple(int(n) for n in lengths), max(lengths), tuple(buckets))
