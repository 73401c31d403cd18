"""2D rotary position embedding of the Qwen2.5-VL vision tower.

The head dim D is split in halves that rotate as pairs (i, i + D/2). The D/2 pair angles are
[row angles (D/4) | col angles (D/4)]:

    angle[:, :D/4]    = row * inv_freq        inv_freq[j] = theta ** (-2j / (D/2)),  j < D/4
    angle[:, D/4:]    = col * inv_freq

    out[..., :D/2] = x1 * cos - x2 * sin      (x1 = x[..., :D/2], x2 = x[..., D/2:])
    out[..., D/2:] = x2 * cos + x1 * sin

which is transformers' ``x * cos + rotate_half(x) * sin`` with the angles repeated twice, without
materializing the repeated [N, D] tables.
"""

from __future__ import annotations

import torch


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies, [head_dim // 4] float32."""
    half = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the pair angles for (row, col) positions [N, 2]: each [N, head_dim // 2] float32."""
    angles = positions.to(torch.float32)[:, :, None] * inv_freq.to(positions.device)  # [N, 2, D/4]
    angles = angles.reshape(positions.shape[0], -1)  # [N, D/2] = [rows | cols]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, ..., D] by per-token angles (cos/sin [N, D/2]); computed in float32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.view(shape), sin.view(shape)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
