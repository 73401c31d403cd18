"""What every packed vision layout shares, whatever the family's token order.

A batch is items packed back to back (each ``t`` frames of h x w patches); a family's layout is a
NamedTuple of CPU tensors and ``Segments`` computed from ``grid_thw`` alone, so it is built once
per distinct batch shape (cached) and moved to the device by the tower (``packed_tower``). This
module holds the parts that do not depend on the order: the grid check and the move to a device
(the attention segments themselves are the kernels' input, ``encoder.kernels.segments``). The orders live in ``windows`` (Qwen2.5-VL) and ``mimo_layout`` (MiMo ViT).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, Self

import torch

from encoder.models.family import Grid


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
