"""Partial rotary: the in-place half-split rotation against the rotate_half formula it replaces."""

from __future__ import annotations

import pytest
import torch

from llm_core.rope import PartialRotary, apply_partial_rotary, apply_partial_rotary_


def rotate_half_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' formulation: x_rot * cos + rotate_half(x_rot) * sin, pass-through concatenated."""
    width = cos.shape[-1]
    x_rot, x_pass = x[..., :width], x[..., width:]
    x1, x2 = x_rot[..., : width // 2], x_rot[..., width // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((x_rot * cos[:, None, :] + rotated * sin[:, None, :], x_pass), dim=-1)


@pytest.mark.parametrize("rope_dim", [10, 21, 64])
def test_rotation_is_bit_identical_to_rotate_half(rope_dim: int) -> None:
    rot = PartialRotary(rope_dim, 1e4)
    g = torch.Generator().manual_seed(rope_dim)
    positions = torch.randint(0, 5000, (37,), generator=g)
    cos, sin = rot.cos_sin(positions, torch.float32)
    assert cos.shape == (37, rot.width)
    # A strided view, like q/k inside a fused qkv projection output.
    buf = torch.randn(37, 6 * 64 + 50, generator=g)
    x = buf[:, : 6 * 64].view(37, 6, 64)
    ref = rotate_half_reference(x, cos, sin)
    assert torch.equal(apply_partial_rotary(x, cos, sin), ref)
    before = buf.clone()
    out = apply_partial_rotary_(x, cos, sin)
    assert out.data_ptr() == x.data_ptr() and torch.equal(out, ref)
    assert torch.equal(buf[:, 6 * 64 :], before[:, 6 * 64 :])  # columns outside the view untouched
