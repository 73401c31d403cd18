"""Launcher glue shared by the segment-attention Triton kernels (``triton_varlen``, ``triton_band``).

Both kernels run one program per (segment, query head, block of BLOCK_M queries) over q [N, Hq, D],
k/v [N, Hkv, D] packed segment after segment, and take the same leading parameters and tile
constants; only their extras (sinks, band, GQA groups) differ:

    kernel(Q, K, V, Out, *extras, CuSeqlens, sm_scale, 8 strides (n, h of q, k, v, out),
           *own constexprs, HEAD_DIM, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PRECISION)

The kernels index D with unit stride, so the operands are made last-dim contiguous here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton


class SegmentOperands(NamedTuple):
    """The tensors of one launch, ready for the kernels' pointer math."""

    q: torch.Tensor  # [N, Hq, D], last dim contiguous
    k: torch.Tensor  # [N, Hkv, D], last dim contiguous
    v: torch.Tensor  # [N, Hkv, D], last dim contiguous
    out: torch.Tensor  # [N, Hq, D], like q (uninitialised until the kernel writes it)
    cu_seqlens: torch.Tensor  # [S + 1], as given (made int32 at launch)

    def grid(self, max_seqlen: int, block_m: int) -> tuple[int, int, int]:
        """(segments, query heads, query blocks of the longest segment); programs whose block starts
        past their own segment's end exit at once."""
        return (self.cu_seqlens.numel() - 1, self.q.shape[1], triton.cdiv(max_seqlen, block_m))

    def args(self, *extras: torch.Tensor) -> tuple[torch.Tensor | float | int, ...]:
        """The kernels' positional parameters, ``extras`` (pointers) between Out and CuSeqlens."""
        q, k, v, out = self.q, self.k, self.v, self.out
        return (
            q,
            k,
            v,
            out,
            *extras,
            self.cu_seqlens.to(torch.int32),
            q.shape[2] ** -0.5,  # softmax scale 1/sqrt(D)
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            out.stride(0),
            out.stride(1),
        )

    def tile_constants(self, block_m: int, block_n: int) -> dict[str, int | str]:
        """HEAD_DIM, the tile sizes (D padded to a power of two >= 16, which tl.dot needs) and the dot
        precision: IEEE for fp32 inputs so the kernels agree with the torch paths to ~1e-6."""
        head_dim = self.q.shape[2]
        return {
            "HEAD_DIM": head_dim,
            "BLOCK_M": block_m,
            "BLOCK_N": block_n,
            "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
            "DOT_PRECISION": "ieee" if self.q.dtype == torch.float32 else "tf32",
        }


def segment_operands(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor
) -> SegmentOperands:
    """Check ``cu_seqlens`` [S + 1], make q/k/v last-dim contiguous, allocate the output."""
    assert cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 2
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    return SegmentOperands(q, k, v, torch.empty_like(q), cu_seqlens)
