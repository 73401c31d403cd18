"""The MiMo ViT token layout: per-frame segments, the column order, rotary positions."""

from __future__ import annotations

import pytest
import torch

from encoder.models.mimo_layout import mimo_layout, reorder_units


def test_column_order_of_one_frame() -> None:
    """A 6x8-patch frame is 3x4 merge units; column-major lists them 0 4 8 | 1 5 9 | ..."""
    layout = mimo_layout([(1, 6, 8)], 2)
    assert layout.column_index.tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]
    assert torch.equal(layout.column_index[layout.row_index], torch.arange(12))


def test_column_order_is_per_frame_and_per_item() -> None:
    """Whole units move inside their own frame; frames and items keep their place."""
    layout = mimo_layout([(2, 4, 2), (1, 2, 4)], 2)  # frames of 2x1, 2x1 and 1x2 units
    assert layout.column_index.tolist() == [0, 1, 2, 3, 4, 5]  # a single column / row is unchanged
    layout = mimo_layout([(2, 4, 4), (1, 4, 6)], 2)  # 2x2, 2x2, 2x3 units
    assert layout.column_index.tolist() == [0, 2, 1, 3, 4, 6, 5, 7, 8, 11, 9, 12, 10, 13]


def test_one_segment_per_frame() -> None:
    layout = mimo_layout([(3, 4, 6), (1, 2, 2)], 2)
    assert layout.frames.lengths == (24, 24, 24, 4)
    assert layout.frames.cu_seqlens.tolist() == [0, 24, 48, 72, 76]


def test_positions_in_merge_unit_order() -> None:
    """Patch (row, col) in its frame: 2x2 units in raster order, each unit's 4 patches raster."""
    layout = mimo_layout([(2, 2, 4)], 2)
    frame = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    assert [tuple(p) for p in layout.positions.tolist()] == frame + frame  # every frame restarts


def test_reorder_units_round_trip() -> None:
    layout = mimo_layout([(2, 6, 8)], 2)
    x = torch.randn(96, 5)
    col = reorder_units(x, layout.column_index, 4)
    assert torch.equal(col[4:8], x[16:20])  # second unit in column order = unit 4 (row 1, col 0)
    assert torch.equal(reorder_units(col, layout.row_index, 4), x)


@pytest.mark.parametrize("grid", [(1, 3, 4), (1, 4, 5), (0, 4, 4), (1, 0, 2)])
def test_bad_grid_names_it(grid: tuple[int, int, int]) -> None:
    with pytest.raises(ValueError, match=r"grid_thw \("):
        mimo_layout([grid], 2)
    with pytest.raises(ValueError, match="empty batch"):
        mimo_layout([], 2)
