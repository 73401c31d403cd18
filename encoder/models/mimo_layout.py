"""Token layout of a packed MiMo ViT batch: rotary positions, the column order, per-frame segments.

A pure function of ``grid_thw`` and the merge size, computed once per distinct batch shape on the
CPU (cached) and moved to the device by the tower.

Rows arrive item after item, frame after frame, and within a frame as 2x2 merge units in raster
order of the merged grid (each unit = 4 consecutive rows). Row-band blocks run on that order.
Column-band blocks run on the column-major order of the units of each frame (whole units move;
frames stay in place), e.g. one frame of 3x4 merged units:

    merged grid (unit ids)     column order (unit ids)
     0  1  2  3                0 4 8 | 1 5 9 | 2 6 10 | 3 7 11
     4  5  6  7
     8  9 10 11                column_index = [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]

A run of column blocks enters with ``x_units[column_index]`` and leaves with ``x_units[row_index]``
(row_index = argsort(column_index)). Unit 0 of a frame is first in both orders, so "key 0 of the
frame" (where the sinks act) is the same token in both. Attention never crosses a frame: one
segment per frame (t per item), even in full blocks; segments keep their boundaries in both orders.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

import torch

from encoder.kernels.segments import Segments, make_segments
from encoder.models.family import Grid
from encoder.models.packed_layout import checked_grids, fields_to


class MiMoLayout(NamedTuple):
    """How one packed batch is laid out. N = total patches, U = N // merge_unit units."""

    positions: torch.Tensor  # [N, 2] long, (row, col) of each patch in its frame, input (row) order
    column_index: torch.Tensor  # [U] long, column order -> input unit index
    row_index: torch.Tensor  # [U] long, input unit index -> column order (inverse of column_index)
    frames: Segments  # one segment per frame, over either order

    def to(self, device: torch.device) -> MiMoLayout:
        return self if self.positions.device == device else MiMoLayout(*fields_to(self, device))


def reorder_units(x: torch.Tensor, index: torch.Tensor, unit: int) -> torch.Tensor:
    """Rows of ``x`` [N, ...] regrouped by whole units: unit u of the result is unit index[u] of x."""
    return x.view(x.shape[0] // unit, unit, *x.shape[1:])[index].reshape(x.shape)


def frame_positions(h: int, w: int, merge: int) -> torch.Tensor:
    """(row, col) of every patch of one h x w frame in merge-unit raster order: [h*w, 2] long."""
    rows = torch.arange(h).view(h // merge, 1, merge, 1).expand(h // merge, w // merge, merge, merge)
    cols = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, w // merge, merge, merge)
    return torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=-1)


def frame_column_order(h_units: int, w_units: int) -> torch.Tensor:
    """The frame's unit ids (raster) listed column by column: [h_units * w_units] long."""
    return torch.arange(h_units * w_units).view(h_units, w_units).t().reshape(-1)


@lru_cache(maxsize=256)
def _layout_cached(grids: tuple[Grid, ...], merge: int) -> MiMoLayout:
    positions: list[torch.Tensor] = []
    column: list[torch.Tensor] = []
    frame_lens: list[int] = []
    base = 0  # first unit id of the current frame
    for t, h, w in grids:
        hu, wu = h // merge, w // merge
        pos = frame_positions(h, w, merge)
        order = frame_column_order(hu, wu)
        for _ in range(t):
            positions.append(pos)
            column.append(order + base)
            frame_lens.append(h * w)
            base += hu * wu
    column_index = torch.cat(column)
    return MiMoLayout(
        positions=torch.cat(positions),
        column_index=column_index,
        row_index=torch.argsort(column_index),
        frames=make_segments(frame_lens),
    )


def mimo_layout(grids: Sequence[Grid], spatial_merge_size: int) -> MiMoLayout:
    """Layout of a packed batch of items with patch grids ``grids`` (t, h, w), on the CPU.

    Raises ``ValueError`` naming the grid when a side is not a positive multiple of the merge size.
    """
    return _layout_cached(checked_grids(grids, spatial_merge_size), spatial_merge_size)
