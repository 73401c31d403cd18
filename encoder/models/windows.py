"""Token layout of a packed vision batch: window order, rotary positions and attention segments.

Everything here is a pure function of ``grid_thw`` and a few config integers, so it is computed
once per distinct batch shape on the CPU (cached) and moved to the device by the model.

Input rows arrive item after item, frame after frame, and within a frame as 2x2 merge groups in
raster order of the merged grid (4 consecutive rows = one merged unit). Window attention needs
each window's tokens contiguous, so units are reordered window by window before the blocks and
restored after the merger. Example: one frame of 6x6 merged units, window side 4 (units):

    merged grid (unit ids)       windows (side 4)         window order (unit ids)
     0  1  2  3 |  4  5          A A A A | B B            A:  0  1  2  3  6  7  8  9
     6  7  8  9 | 10 11          A A A A | B B                12 13 14 15 18 19 20 21
    12 13 14 15 | 16 17          A A A A | B B            B:  4  5 10 11 16 17 22 23
    18 19 20 21 | 22 23          A A A A | B B            C: 24 25 26 27 30 31 32 33
    ------------+------          --------+----            D: 28 29 34 35
    24 25 26 27 | 28 29          C C C C | D D
    30 31 32 33 | 34 35          C C C C | D D            window lengths (in patches) = 4 * units:
                                                          [64, 32, 32, 16]

Edge windows are smaller (no padding tokens exist). Full-attention blocks attend within one frame
(``t`` segments of h*w patches per item, as Qwen2.5-VL does); frames stay contiguous in window
order because windows never cross a frame. (``Segments`` themselves, shared with the MiMo layout
and the audio tokenizer, are the kernels' input: ``encoder.kernels.segments``.)
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

import torch

from encoder.kernels.segments import Segments, make_segments
from encoder.models.family import Grid
from encoder.models.packed_layout import checked_grids, fields_to


class VisionLayout(NamedTuple):
    """How one packed batch is laid out. N = total patches, U = N // merge_unit merged units."""

    positions: torch.Tensor  # [N, 2] long, (row, col) of each patch, in window order
    window_index: torch.Tensor  # [U] long, window order -> original unit index
    reverse_index: torch.Tensor  # [U] long, original unit index -> window order
    full: Segments  # one segment per frame
    window: Segments  # one segment per window

    def to(self, device: torch.device) -> VisionLayout:
        return self if self.positions.device == device else VisionLayout(*fields_to(self, device))


def _unit_positions(h_units: int, w_units: int, merge: int) -> torch.Tensor:
    """(row, col) of every patch of one frame in merge-group order: [h_units*w_units*merge^2, 2]."""
    ur, uc = torch.meshgrid(torch.arange(h_units), torch.arange(w_units), indexing="ij")  # [hu, wu]
    dr, dc = torch.meshgrid(torch.arange(merge), torch.arange(merge), indexing="ij")  # [m, m]
    rows = ur.reshape(-1, 1) * merge + dr.reshape(1, -1)  # [U, m*m]
    cols = uc.reshape(-1, 1) * merge + dc.reshape(1, -1)
    return torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=-1)


def _frame_windows(h_units: int, w_units: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Window order of one frame's units and the window sizes (in units)."""
    n_wr = -(-h_units // side)
    n_wc = -(-w_units // side)
    ur, uc = torch.meshgrid(torch.arange(h_units), torch.arange(w_units), indexing="ij")
    window_id = ((ur // side) * n_wc + (uc // side)).reshape(-1)  # [U]
    # A stable sort keeps raster order inside each window.
    order = torch.sort(window_id, stable=True).indices
    sizes = torch.bincount(window_id, minlength=n_wr * n_wc)
    assert int(sizes.min()) > 0, "every window holds at least one unit"
    return order, sizes


@lru_cache(maxsize=256)
def _layout_cached(grids: tuple[Grid, ...], merge: int, window_side: int) -> VisionLayout:
    unit = merge * merge
    positions: list[torch.Tensor] = []
    window_index: list[torch.Tensor] = []
    window_lens: list[int] = []
    frame_lens: list[int] = []
    base = 0  # first unit id of the current frame
    for t, h, w in grids:
        hu, wu = h // merge, w // merge
        pos = _unit_positions(hu, wu, merge)  # [h*w, 2]
        order, sizes = _frame_windows(hu, wu, window_side)
        pos_windowed = pos.view(hu * wu, unit, 2)[order].reshape(-1, 2)
        for _ in range(t):
            positions.append(pos_windowed)
            window_index.append(order + base)
            window_lens.extend(int(s) * unit for s in sizes)
            frame_lens.append(h * w)
            base += hu * wu
    index = torch.cat(window_index)
    return VisionLayout(
        positions=torch.cat(positions),
        window_index=index,
        reverse_index=torch.argsort(index),
        full=make_segments(frame_lens),
        window=make_segments(window_lens),
    )


def vision_layout(grids: Sequence[Grid], spatial_merge_size: int, window_merged: int) -> VisionLayout:
    """Layout of a packed batch of items with patch grids ``grids`` (t, h, w), on the CPU.

    ``window_merged`` is the window side in merged units (window_size // merge // patch).
    Raises ``ValueError`` naming the grid when h or w is not a multiple of the merge size.
    """
    return _layout_cached(checked_grids(grids, spatial_merge_size), spatial_merge_size, window_merged)
