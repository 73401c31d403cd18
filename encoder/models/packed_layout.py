"""What every packed vision layout shares, whatever the family's token order.

A batch is items packed back to back (each ``t`` frames of h x w patches); a family's layout is a
NamedTuple of CPU tensors and ``Segments`` computed from ``grid_thw`` alone, so it is built once
per distinct batch shape (cached) and moved to the device by the tower (``packed_tower``). This
module holds the parts that do not depend on the order: the attention segments, the grid check,
the move to a device. The orders live in ``windows`` (Qwen2.5-VL) and ``mimo_layout`` (MiMo ViT).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, Self

import torch

from encoder.models.family import Grid


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


class PackedLayout(Protocol):
    """What the shared tower code (``packed_tower.PackedTower``) reads from a family's layout."""

    @property
    def positions(self) -> torch.Tensor: ...  # [N, 2] long, (row, col) of each patch: N sizes the batch

    def to(self, device: torch.device) -> Self: ...


def fields_to(layout: tuple[Any, ...], device: torch.device) -> list[Any]:
    """The fields of a layout NamedTuple on ``device``: tensors copied without blocking (the forward
    that reads them is queued behind the copy on the same stream), ``Segments`` through their ``to``."""
    return [f.to(device, non_blocking=True) if isinstance(f, torch.Tensor) else f.to(device) for f in layout]


def checked_grids(grids: Sequence[Grid], spatial_merge_size: int) -> tuple[Grid, ...]:
    """``grids`` as a tuple of int triples (hashable: the layout caches key on it).

    Raises ``ValueError`` on an empty batch, or naming the grid when a side is not a positive
    multiple of the merge size (a merge unit would straddle the edge).
    """
    if not grids:
        raise ValueError("empty batch: grid_thw has no items")
    norm: list[Grid] = []
    for g in grids:
        t, h, w = (int(x) for x in g)
        if t < 1 or h < 1 or w < 1 or h % spatial_merge_size or w % spatial_merge_size:
            raise ValueError(
                f"grid_thw {(t, h, w)} is invalid: t, h, w must be positive and h, w multiples of "
                f"spatial_merge_size={spatial_merge_size}"
            )
        norm.append((t, h, w))
    return tuple(norm)
