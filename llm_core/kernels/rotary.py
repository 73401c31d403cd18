"""The in-place half-split rotary rotation, shared by the model's reference paths (``models.rope``)
and the torch and Triton attention backends (``backends.attention``), which rotate q and k between
the qkv projection and the KV store."""

from __future__ import annotations

from torch import Tensor


def apply_partial_rotary_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, H, D] in place (cos/sin [T, width], width <= D) and return it.

    With x = [x1 | x2 | rest] (x1, x2 of width / 2) this is the half-split rotation
    ``[x1 c - x2 s | x2 c + x1 s | rest]`` (c, s: the first half of cos/sin; the tables repeat
    their halves). The same products and sums as ``rotate_half`` and concatenation, so the same
    values, but only the rotated columns are touched and nothing is concatenated: for a fresh
    projection output (a temporary) the pass-through columns are never copied.
    """
    width = cos.shape[-1]
    half = width // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # [T, 1, width / 2]
    x1, x2 = x[..., :half], x[..., half:width]
    x1s, x2s = x1 * s, x2 * s
    x1.mul_(c).sub_(x2s)
    x2.mul_(c).add_(x1s)
    return x
