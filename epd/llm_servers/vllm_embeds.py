"""Embeddings as vLLM's ``--enable-mm-embeds`` chat parts, checked before they leave.

A part per item (vLLM takes one grid per part)::

    {"type": "image_embeds", "uuid": MediaKey,
     "image_embeds": {"image_embeds": b64(torch.save([rows, hidden])), "image_grid_thw": [t, h, w]}}
    {"type": "video_embeds", "uuid": MediaKey,
     "video_embeds": {"video_embeds": ..., "video_grid_thw": [t, h, w],
                      "second_per_grid_ts": b64(torch.save(tensor(seconds)))}}  # 0-d

vLLM's server process exits on an embedding whose rows disagree with its grid, or whose width is
not the language model's hidden size, so both are checked here: rows = t*h*w / merge^2 (the
spatial merge of the tower), width = hidden. The MediaKey as ``uuid`` keys vLLM's own caches.
"""

from __future__ import annotations

import base64
import io
import math
from typing import Any, NamedTuple

import torch

from epd_common.messages.embedding_ref import EmbeddingRef


class EmbeddingGeometry(NamedTuple):
    """What the language model takes: the tower's spatial merge and the hidden size."""

    merge: int
    hidden: int


class EmbeddingMismatch(ValueError):
    """An embedding that does not fit its grid or the model: never sent."""


# A temporal patch spans two sampled frames: more than an hour is no video's (and an out-of-range
# value drives vLLM's M-RoPE positions out of bounds).
MAX_SECONDS_PER_PATCH = 3600.0


def check_seconds(ref: EmbeddingRef) -> None:
    """A video's seconds per temporal patch must be finite and in (0, MAX_SECONDS_PER_PATCH]."""
    s = ref.seconds_per_grid_t
    if (
        ref.modality == "video"
        and s is not None
        and not (math.isfinite(s) and 0 < s <= MAX_SECONDS_PER_PATCH)
    ):
        raise EmbeddingMismatch(f"seconds per temporal patch {s} is not in (0, {MAX_SECONDS_PER_PATCH:g}]")


def expected_rows(grid_thw: tuple[int, int, int], merge: int) -> int:
    t, h, w = grid_thw
    if h % merge or w % merge:
        raise EmbeddingMismatch(f"grid {list(grid_thw)} is not a multiple of the spatial merge {merge}")
    return t * h * w // (merge * merge)


def check_embedding(ref: EmbeddingRef, tensor: torch.Tensor, geometry: EmbeddingGeometry) -> None:
    """Raise ``EmbeddingMismatch`` unless ``tensor`` is [t*h*w/merge^2, hidden] for ref's one grid."""
    if len(ref.grid_thw) != 1:
        raise EmbeddingMismatch(f"one grid per item expected, got {len(ref.grid_thw)}")
    if tensor.dim() != 2:
        raise EmbeddingMismatch(f"rank {tensor.dim()} embedding (expected [rows, hidden])")
    if not tensor.is_floating_point():
        raise EmbeddingMismatch(f"embedding dtype {tensor.dtype} is not floating point")
    rows = expected_rows(ref.grid_thw[0], geometry.merge)
    if tensor.shape[0] != rows:
        raise EmbeddingMismatch(
            f"{tensor.shape[0]} rows where the grid {list(ref.grid_thw[0])} needs {rows} "
            f"(t*h*w / {geometry.merge}^2)"
        )
    if tensor.shape[1] != geometry.hidden:
        raise EmbeddingMismatch(
            f"width {tensor.shape[1]} where the language model's hidden size is {geometry.hidden}"
        )
    if ref.modality == "image" and ref.grid_thw[0][0] != 1:
        raise EmbeddingMismatch(f"an image grid must have t = 1, got {list(ref.grid_thw[0])}")
    check_seconds(ref)


def tensor_b64(tensor: torch.Tensor) -> str:
    """``torch.save`` bytes of a compact copy (a view would save its whole storage), base64."""
    buf = io.BytesIO()
    torch.save(tensor.detach().contiguous().clone(), buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def metadata_part(ref: EmbeddingRef) -> dict[str, Any]:
    """The chat part of an item without its embedding bytes: the grid that sizes its placeholders,
    a video's seconds per temporal patch, and the uuid (a file transport names the bytes by it)."""
    kind = "image" if ref.modality == "image" else "video"
    payload: dict[str, Any] = {
        f"{kind}_grid_thw": list(ref.grid_thw[0]),  # JSON metadata arrays are taken as int tensors
    }
    if kind == "video" and ref.seconds_per_grid_t is not None:
        # M-RoPE's temporal spacing: a 0-d tensor (vLLM stacks one per video; a JSON array is a 400,
        # and a 1-d tensor passes its parser but kills its engine core)
        payload["second_per_grid_ts"] = tensor_b64(
            torch.tensor(float(ref.seconds_per_grid_t), dtype=torch.float64)
        )
    return {"type": f"{kind}_embeds", f"{kind}_embeds": payload, "uuid": ref.key}


def embeds_part(ref: EmbeddingRef, tensor: torch.Tensor, geometry: EmbeddingGeometry) -> dict[str, Any]:
    """The chat part of one checked item, its embedding inline."""
    check_embedding(ref, tensor, geometry)
    part = metadata_part(ref)
    part[part["type"]][part["type"]] = tensor_b64(tensor)
    return part
