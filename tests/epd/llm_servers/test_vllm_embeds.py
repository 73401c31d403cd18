"""The embedding checks before a part goes to vLLM (epd/llm_servers/vllm_embeds.py): rows against
the grid and the spatial merge, width against the hidden size, rank and dtype; the part's layout."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from epd.llm_servers.vllm_embeds import (
    EmbeddingGeometry,
    EmbeddingMismatch,
    check_embedding,
    embeds_part,
    expected_rows,
)
from epd_common.messages.embedding_ref import EmbeddingRef

GEO = EmbeddingGeometry(merge=2, hidden=8)


def ref(
    rows: int, grid: tuple[int, int, int], modality: str = "image", seconds: float | None = None
) -> EmbeddingRef:
    return EmbeddingRef(
        key="ab" * 32,
        dtype="float32",
        shape=(rows, 8),
        grid_thw=(grid,),
        modality=modality,
        seconds_per_grid_t=seconds,
    )


def load(b64: str) -> torch.Tensor:
    out = torch.load(io.BytesIO(base64.b64decode(b64)), weights_only=True)
    assert isinstance(out, torch.Tensor)
    return out


def test_rows_follow_the_grid_and_merge() -> None:
    assert expected_rows((1, 16, 16), 2) == 64
    assert expected_rows((3, 6, 6), 2) == 27
    with pytest.raises(EmbeddingMismatch, match="multiple of the spatial merge"):
        expected_rows((1, 5, 4), 2)


@pytest.mark.parametrize(
    ("tensor", "grid", "match"),
    [
        (torch.zeros(15, 8), (1, 8, 8), "15 rows where the grid \\[1, 8, 8\\] needs 16"),
        (torch.zeros(17, 8), (1, 8, 8), "17 rows"),
        (torch.zeros(16, 9), (1, 8, 8), "width 9 where the language model's hidden size is 8"),
        (torch.zeros(1, 16, 8), (1, 8, 8), "rank 3"),
        (torch.zeros(16, 8, dtype=torch.int32), (1, 8, 8), "not floating point"),
        (torch.zeros(32, 8), (2, 8, 8), "t = 1"),
    ],
)
def test_a_misfit_is_refused(tensor: torch.Tensor, grid: tuple[int, int, int], match: str) -> None:
    with pytest.raises(EmbeddingMismatch, match=match):
        check_embedding(ref(tensor.shape[0], grid), tensor, GEO)
    with pytest.raises(EmbeddingMismatch):
        embeds_part(ref(tensor.shape[0], grid), tensor, GEO)


def test_one_grid_per_item() -> None:
    two = EmbeddingRef(key="cd" * 32, dtype="float32", shape=(8, 8), grid_thw=((1, 4, 4), (1, 4, 4)))
    with pytest.raises(EmbeddingMismatch, match="one grid per item"):
        check_embedding(two, torch.zeros(8, 8), GEO)


def test_image_part_layout() -> None:
    base = torch.arange(40 * 8, dtype=torch.float32).view(40, 8)
    view = base[4:20]  # a view into a larger storage: only its rows travel
    part = embeds_part(ref(16, (1, 8, 8)), view, GEO)
    assert part["type"] == "image_embeds" and part["uuid"] == "ab" * 32
    payload = part["image_embeds"]
    assert payload["image_grid_thw"] == [1, 8, 8]
    sent = load(payload["image_embeds"])
    assert torch.equal(sent, view) and sent.untyped_storage().nbytes() == 16 * 8 * 4


def test_video_part_carries_seconds_per_patch_as_a_scalar() -> None:
    part = embeds_part(ref(32, (2, 8, 8), "video", seconds=2.0), torch.ones(32, 8), GEO)
    payload = part["video_embeds"]
    assert part["type"] == "video_embeds" and payload["video_grid_thw"] == [2, 8, 8]
    seconds = load(payload["second_per_grid_ts"])
    assert seconds.dim() == 0 and seconds.item() == 2.0  # a 1-d tensor kills vLLM's engine core


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("inf"), float("nan"), 1e9])
def test_seconds_per_patch_out_of_range_is_refused(seconds: float) -> None:
    with pytest.raises(EmbeddingMismatch, match="seconds per temporal patch"):
        embeds_part(ref(32, (2, 8, 8), "video", seconds=seconds), torch.ones(32, 8), GEO)
