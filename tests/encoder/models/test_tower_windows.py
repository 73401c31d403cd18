"""Window layout invariants and parity with transformers' get_vision_window_index."""

from __future__ import annotations

import pytest
import torch

from encoder.kernels.segments import make_segments
from encoder.models.windows import vision_layout

CASES = [
    [(1, 8, 12)],
    [(1, 16, 16)],  # exact multiple of the window: no ragged edge
    [(1, 6, 10), (3, 4, 6), (2, 2, 2)],
    [(1, 34, 22)],
]


@pytest.mark.parametrize("grids", CASES)
@pytest.mark.parametrize("window_merged", [1, 2, 4])
def test_matches_transformers(grids: list[tuple[int, int, int]], window_merged: int) -> None:
    from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

    patch, merge = 14, 2
    grid_thw = torch.tensor(grids)
    ref_index, ref_cu = get_vision_window_index(grid_thw, merge, window_merged * merge * patch, patch)
    ours = vision_layout(grids, merge, window_merged)
    assert torch.equal(ours.window_index, ref_index)
    assert ours.window.cu_seqlens.tolist() == ref_cu.tolist()
    ref_pos = get_vision_position_ids(grid_thw, merge)  # [N, 2], original order
    n = ref_pos.shape[0]
    ref_pos_windowed = ref_pos.view(n // 4, 4, 2)[ref_index].reshape(n, 2)
    assert torch.equal(ours.positions, ref_pos_windowed)
    frames = [h * w for t, h, w in grids for _ in range(t)]
    assert list(ours.full.lengths) == frames


@pytest.mark.parametrize("grids", CASES)
def test_invariants(grids: list[tuple[int, int, int]]) -> None:
    lay = vision_layout(grids, 2, 2)
    units = sum(t * h * w for t, h, w in grids) // 4
    assert sorted(lay.window_index.tolist()) == list(range(units))  # a permutation
    assert torch.equal(lay.window_index[lay.reverse_index], torch.arange(units))
    for seg in (lay.full, lay.window):
        assert int(seg.cu_seqlens[-1]) == units * 4 == sum(seg.lengths)
        covered = torch.cat([b.positions.reshape(-1) for b in seg.buckets])
        assert sorted(covered.tolist()) == list(range(units * 4))  # buckets tile the sequence
    assert max(lay.window.lengths) <= 2 * 2 * 4


def test_rejects_bad_grids() -> None:
    with pytest.raises(ValueError, match="multiples of spatial_merge_size"):
        vision_layout([(1, 3, 4)], 2, 2)
    with pytest.raises(ValueError, match="empty batch"):
        vision_layout([], 2, 2)
    with pytest.raises(AssertionError):
        make_segments([3, 0])
