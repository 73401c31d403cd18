"""Partial rotary position embedding with per-layer-type theta (MiMo-V2-Flash convention).

Only the leading ``width`` dims of each q/k head rotate; the rest pass through unchanged:

    head dim:  [ 0 .......... width | width ........ head_dim ]
                 rotated (half-split)    passed through

``rope_dim = int(head_dim * partial_rotary_factor)`` sets the frequency spacing
(``theta ** (-2j / rope_dim)`` for j < ceil(rope_dim / 2)) and the rotated width is
``2 * ceil(rope_dim / 2)``, which is what transformers computes. Rotation uses the half-split
("rotate_half") pairing: dim j pairs with dim j + width / 2.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor, nn

from llm_core.kernels.rotary import apply_partial_rotary_

__all__ = ["PartialRotary", "apply_partial_rotary", "apply_partial_rotary_", "mrope_rows"]


class PartialRotary(nn.Module):
    """cos/sin tables computed on the fly from positions (cheap next to attention; no max length)."""

    def __init__(self, rope_dim: int, theta: float) -> None:
        super().__init__()
        assert rope_dim >= 2, rope_dim
        self.rope_dim = rope_dim
        self.theta = theta
        self.width = 2 * ((rope_dim + 1) // 2)

    @property
    def key(self) -> tuple[int, float]:
        """(rope_dim, theta): layers with the same key share a step's cos/sin tables."""
        return self.rope_dim, self.theta

    def inv_freq(self, device: torch.device) -> Tensor:
        """fp32 [width / 2]. Recomputed per call (a handful of elements): no buffer to move or load."""
        exponents = torch.arange(0, self.rope_dim, 2, dtype=torch.float32, device=device) / self.rope_dim
        return 1.0 / (self.theta**exponents)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions int [T] -> (cos, sin) each [T, width] in ``dtype`` (angles computed in fp32)."""
        freqs = (
            positions.to(torch.float32)[:, None] * self.inv_freq(positions.device)[None, :]
        )  # [T, width/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, width]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """q [T, H, D], k [T, Hkv, D], positions [T] -> rotated (q, k), same shapes and dtype."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_partial_rotary(q, cos, sin), apply_partial_rotary(k, cos, sin)


def apply_partial_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D]; cos/sin [T, width] with width <= D. Returns a new tensor [T, H, D]."""
    return apply_partial_rotary_(x.clone(), cos, sin)


def mrope_rows(table: Tensor, positions: Tensor, section: tuple[int, ...]) -> Tensor:
    """M-RoPE rows: table [N, width] (cos or sin per position, halves repeated), positions [3, T]
    (temporal, height, width, all >= 0 and < N) -> [T, width], where frequency j takes the row of
    its section's axis.

    The width / 2 frequencies are split into ``section`` = (s_t, s_h, s_w) consecutive runs, and
    the second half of the columns repeats the first::

        columns   [ t: s_t | h: s_h | w: s_w | t: s_t | h: s_h | w: s_w ]
    """
    width = table.shape[1]
    assert sum(section) * 2 == width and positions.dim() == 2 and positions.shape[0] == len(section)
    axis = _mrope_axis(section, positions.device)
    if table.device.type == positions.device.type == "cpu" and not table.requires_grad:
        # The same gather in numpy: torch splits a prefill's (thousands of rows) over its threads,
        # which wait for cores the layer kernel's threads still spin on; numpy runs it on this one.
        rows = np.ascontiguousarray(table.numpy()).reshape(-1)  # [N * width]
        flat = (positions.numpy() * width)[axis.numpy()].T + np.arange(width)  # [T, width]
        return torch.from_numpy(rows.take(flat))  # out[t, j] = table[positions[axis[j], t], j]
    # the position column j reads, per token: positions[axis[j], t] -> [T, width]
    index = positions.index_select(0, axis).t()
    return table.gather(0, index)  # out[t, j] = table[index[t, j], j]


@functools.lru_cache(maxsize=16)
def _mrope_axis(section: tuple[int, ...], device: torch.device) -> Tensor:
    """int64 [width]: the position axis of each rotary column (built once per section and device)."""
    with torch.inference_mode(False):  # a plain tensor, usable inside and outside inference mode
        axis = torch.cat([torch.full((n,), a, dtype=torch.int64) for a, n in enumerate(section)])
        return torch.cat([axis, axis]).to(device)  # [width]
