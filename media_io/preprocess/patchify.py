"""Normalize uint8 pixels and cut them into Qwen2-VL patch rows, in one pass of torch ops.

Layout (the contract every backend must meet, identical to transformers' Qwen2-VL processors):

    pixel_values [N, 1176] float32, N = t * h * w patches, grid_thw = (t, h, w) in patches

    rows are ordered   t -> h/2 -> w/2 -> 2 (merge row) -> 2 (merge col)
    so every 4 consecutive rows are one 2x2 merge group:

        patch grid (h=4, w=4)          row order
        +----+----+----+----+          0  1 | 4  5
        | a  | a  | b  | b  |          2  3 | 6  7
        +----+----+----+----+          -----+-----
        | a  | a  | b  | b  |          8  9 |12 13
        +----+----+----+----+         10 11 |14 15
        | c  | c  | d  | d  |
        +----+----+----+----+
        | c  | c  | d  | d  |
        +----+----+----+----+

    each row is (channel 3, temporal 2, patch_y 14, patch_x 14) flattened: 3 * 2 * 14 * 14 = 1176.

An image is one frame repeated ``temporal_patch_size`` times; a video's frame count is padded to a
multiple of ``temporal_patch_size`` by repeating its last frame (what transformers does).

This module knows nothing of decoding or resizing: pixels arrive already at a size whose sides are
multiples of ``patch_size * merge_size``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from media_io.config import PreprocessConfig


class Patches(NamedTuple):
    """One image's or video's patches."""

    pixel_values: torch.Tensor  # [N, 1176] float32, N = t * h * w
    grid_thw: tuple[int, int, int]  # (t, h, w) in patches

    @property
    def num_patches(self) -> int:
        return self.grid_thw[0] * self.grid_thw[1] * self.grid_thw[2]


def _affine(cfg: PreprocessConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``scale, bias`` so that ``x * scale + bias == (x / 255 - mean) / std``."""
    mean = torch.tensor(cfg.image_mean, dtype=torch.float64)
    std = torch.tensor(cfg.image_std, dtype=torch.float64)
    scale = (1.0 / (255.0 * std)).to(torch.float32)
    bias = (-mean / std).to(torch.float32)
    return scale.to(device), bias.to(device)


def patchify_uint8(frames: torch.Tensor, cfg: PreprocessConfig = PreprocessConfig()) -> Patches:
    """Normalize (rescale 1/255, CLIP mean/std) and patchify ``frames``.

    Args:
        frames: ``[T, H, W, 3]`` uint8 RGB (channels last, as decoders produce it), any device.
            ``H`` and ``W`` must be multiples of ``patch_size * merge_size``. ``T == 1`` for an image.

    Returns:
        ``Patches`` with ``pixel_values`` ``[t*h*w, 3*tp*p*p]`` float32 on ``frames.device`` and
        ``grid_thw == (ceil(T / tp), H / p, W / p)``.
    """
    assert frames.dim() == 4 and frames.shape[-1] == 3, f"expected [T, H, W, 3], got {tuple(frames.shape)}"
    assert frames.dtype == torch.uint8, f"expected uint8 pixels, got {frames.dtype}"
    n_frames, height, width, channels = frames.shape
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    assert n_frames >= 1
    assert height % (p * m) == 0 and width % (p * m) == 0, f"{height}x{width} is not a multiple of {p * m}"
    gt, gh, gw = -(-n_frames // tp), height // p, width // p
    scale, bias = _affine(cfg, frames.device)
    scale, bias = scale.view(channels, 1, 1, 1), bias.view(channels, 1, 1, 1)  # broadcast over (tp, p, p)

    # Reorder on uint8 first (4x fewer bytes to move than float32), then one contiguous
    # convert + multiply-add. An image's temporal copies are made by the final expand-reshape,
    # so the normalization runs once per distinct frame.
    if n_frames == 1:
        # [1, H, W, C] -> [gh/m, m, p, gw/m, m, p, C] -> [gh/m, gw/m, m, m, C, 1, p, p]
        src = frames.view(gh // m, m, p, gw // m, m, p, channels).permute(0, 3, 1, 4, 6, 2, 5).unsqueeze(5)
        rows = src.contiguous().to(torch.float32).mul_(scale).add_(bias)
        rows = rows.expand(-1, -1, -1, -1, -1, tp, -1, -1)  # [gh/m, gw/m, m, m, C, tp, p, p]
    else:
        if pad := -n_frames % tp:
            frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
        # [gt*tp, H, W, C] -> [gt, tp, gh/m, m, p, gw/m, m, p, C] -> [gt, gh/m, gw/m, m, m, C, tp, p, p]
        src = frames.view(gt, tp, gh // m, m, p, gw // m, m, p, channels).permute(0, 2, 5, 3, 6, 8, 1, 4, 7)
        rows = src.contiguous().to(torch.float32).mul_(scale).add_(bias)
    pixel_values = rows.reshape(gt * gh * gw, channels * tp * p * p)  # [N, 1176], contiguous
    return Patches(pixel_values, (gt, gh, gw))
