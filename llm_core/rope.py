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

import torch
from torch import Tensor, nn


class PartialRotary(nn.Module):
    """cos/sin tables computed on the fly from positions (cheap next to attention; no max length)."""

    def __init__(self, rope_dim: int, theta: float) -> None:
        super().__init__()
        assert rope_dim >= 2, rope_dim
        self.rope_dim = rope_dim
        self.theta = theta
        self.width = 2 * ((rope_dim + 1) // 2)

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
    width = cos.shape[-1]
    half = width // 2
    x_rot, x_pass = x[..., :width], x[..., width:]
    x1, x2 = x_rot[..., :half], x_rot[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, x_pass), dim=-1)
