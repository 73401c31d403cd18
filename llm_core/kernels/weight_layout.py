"""How the CPU path lays projection weights out in memory.

A projection weight is ``[out, in]`` (``[E, out, in]`` for stacked experts), as checkpoints and
transformers hold it, and ``y = x @ W^T``. ``input_major`` keeps that shape and those values but
stores the memory as ``[in, out]``: ``W^T`` becomes contiguous, and a matmul reads the weight
row-major. With few rows per product (a decode step: one row per sequence; a MoE layer: a few rows
per expert) the weights come cold from DRAM every step, and MKL's sgemm was ~1.25x faster on
``[32, 256] x [256, 896]`` in this layout, the same at prefill sizes (measured, one thread).
The C MoE kernel reads expert weights in this layout only (``in_out_view``).
"""

from __future__ import annotations

from torch import Tensor


def input_major(w: Tensor) -> Tensor:
    """w [..., out, in] -> the same shape and values, stored [..., in, out] (a fresh tensor)."""
    return w.transpose(-1, -2).contiguous().transpose(-1, -2)


def in_out_view(w: Tensor) -> Tensor | None:
    """w [..., out, in] stored input-major -> its memory as a contiguous [..., in, out] tensor (a
    view), or None when it is stored some other way (callers that must not copy weights check)."""
    t = w.transpose(-1, -2)
    return t if t.is_contiguous() else None
