"""1-D rotary embedding of both audio transformers (the tokenizer's and the input local one).

Half-split ("rotate_half", NeoX) over the whole head: dims i and i + D/2 rotate as a pair by
``position * theta ** (-2i / D)``:

    out[..., :D/2] = x1 * cos - x2 * sin          (x1 = x[..., :D/2], x2 = x[..., D/2:])
    out[..., D/2:] = x2 * cos + x1 * sin

Angles are formed in float32 and the rotation is computed in float32, cast back to x's dtype.
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the pair angles for positions [N] (any int dtype): each [N, head_dim // 2] float32."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    )
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [N, D/2]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, H, D] (token-major) by cos/sin [N, D/2]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
