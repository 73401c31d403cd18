"""Normalize uint8 pixels and cut them into Qwen2-VL-layout patch rows, in one pass.

Layout (the contract every backend must meet, identical to transformers' Qwen2-VL processors),
for patch p, merge m (the picture: m = 2) and temporal patch tp, all from ``PreprocessConfig``:

    pixel_values [N, 3 * tp * p * p] float32, N = t * h * w patches, grid_thw = (t, h, w) in patches

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

    each row is (channel 3, temporal tp, patch_y p, patch_x p) flattened: Qwen2-VL's 3 * 2 * 14 * 14
    = 1176 values, MiMo-V2.5's 3 * 2 * 16 * 16 = 1536.

An image is one frame repeated ``temporal_patch_size`` times; a video's frame count is padded to a
multiple of ``temporal_patch_size`` by repeating its last frame (what transformers does).

This module knows nothing of decoding or resizing: pixels arrive already at a size whose sides are
multiples of ``patch_size * merge_size``.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Literal, NamedTuple

import numpy as np
import torch

from epd_common import native
from media_io.config import PreprocessConfig

# The C kernel (built by `pip install`); None when missing or stale, and then the numpy path gives
# the same bits.
_c_kernel: ModuleType | None = native.load("media_io.preprocess._patchify")

Impl = Literal["auto", "c", "numpy", "torch"]

C_KERNEL_AVAILABLE = _c_kernel is not None
# The C kernel's per-patch scratch holds p * p <= 1024 floats (MAX_BLOCK in _patchify.c): patch
# sides up to 32. It has unrolled (and SSE4.1) loops for p = 14 and 16 and a general loop for the rest.
C_MAX_PATCH_AREA = 1024


class Patches(NamedTuple):
    """One image's or video's patches."""

    pixel_values: torch.Tensor  # [N, 3 * tp * p * p] float32, N = t * h * w
    grid_thw: tuple[int, int, int]  # (t, h, w) in patches

    @property
    def num_patches(self) -> int:
        return self.grid_thw[0] * self.grid_thw[1] * self.grid_thw[2]


def _affine(cfg: PreprocessConfig) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel float32 ``scale, bias`` so that ``x * scale + bias == (x / 255 - mean) / std``."""
    mean = np.asarray(cfg.image_mean, dtype=np.float64)
    std = np.asarray(cfg.image_std, dtype=np.float64)
    return (1.0 / (255.0 * std)).astype(np.float32), (-mean / std).astype(np.float32)


def patchify_uint8(
    frames: torch.Tensor | np.ndarray, cfg: PreprocessConfig = PreprocessConfig(), impl: Impl = "auto"
) -> Patches:
    """Normalize (rescale 1/255, ``cfg``'s mean/std) and patchify ``frames``.

    Args:
        frames: ``[T, H, W, 3]`` uint8 RGB (channels last, as decoders produce it), or
            ``[T, H, W, 4]`` RGBX whose 4th byte is ignored (Pillow's layout for RGB): a tensor
            on any device, or a numpy array (read-only is fine: it is never written).
            ``H`` and ``W`` must be multiples of ``patch_size * merge_size``. ``T == 1`` for an image.
        impl: ``"c"`` (the one-pass C kernel), ``"numpy"`` (both CPU only) or ``"torch"``;
            ``"auto"`` picks C on CPU when it was built (and the patch fits it), else numpy. All give the same values.
            The CPU paths are single-threaded on purpose: preprocessing runs in several
            executor threads next to a model that owns torch's intra-op pool, and many small
            OpenMP regions fighting for cores cost far more than they save (measured ~2-5x
            slower under load). The C kernel releases the GIL and writes the output once.

    Returns:
        ``Patches`` with ``pixel_values`` ``[t*h*w, 3*tp*p*p]`` float32 on ``frames.device`` and
        ``grid_thw == (ceil(T / tp), H / p, W / p)``.
    """
    assert frames.ndim == 4 and frames.shape[-1] in (3, 4), (
        f"expected [T, H, W, 3|4], got {tuple(frames.shape)}"
    )
    assert frames.dtype in (torch.uint8, np.uint8), f"expected uint8 pixels, got {frames.dtype}"
    n_frames, height, width, _ = frames.shape
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    assert n_frames >= 1
    assert height % (p * m) == 0 and width % (p * m) == 0, f"{height}x{width} is not a multiple of {p * m}"
    grid = (-(-n_frames // tp), height // p, width // p)
    if isinstance(frames, np.ndarray):
        frames_np: np.ndarray | None = frames
    else:
        frames_np = frames.numpy() if frames.device.type == "cpu" else None
    if impl == "auto":
        c_fits = _c_kernel is not None and p * p <= C_MAX_PATCH_AREA
        impl = "torch" if frames_np is None else "c" if c_fits else "numpy"
    if impl == "c":
        assert frames_np is not None and _c_kernel is not None, (
            "impl='c' needs CPU pixels and the built kernel"
        )
        pixel_values = _rows_c(frames_np, cfg, grid)  # reads RGBX in place
    elif impl == "numpy":
        assert frames_np is not None, "impl='numpy' needs CPU pixels"
        pixel_values = torch.from_numpy(_rows_numpy(frames_np[..., :3], cfg))
    else:
        tensor = torch.from_numpy(frames) if isinstance(frames, np.ndarray) else frames
        pixel_values = _rows_torch(tensor[..., :3], cfg)
    return Patches(pixel_values, grid)


# Both implementations reorder on uint8 first (4x fewer bytes to move than float32), then do one
# contiguous convert + multiply-add. For an image the temporal copies are written last, so the
# normalization runs once per distinct frame.
#
#   image  [1, H, W, C] -> [gh/m, m, p, gw/m, m, p, C] -> [gh/m, gw/m, m, m, C, p, p] -> x tp
#   video  [gt*tp, H, W, C] -> [gt, tp, gh/m, m, p, gw/m, m, p, C]
#                           -> [gt, gh/m, gw/m, m, m, C, tp, p, p]
_IMAGE_PERM = (0, 3, 1, 4, 6, 2, 5)
_VIDEO_PERM = (0, 2, 5, 3, 6, 8, 1, 4, 7)


# The float32 output is the one large write (1080p: ~23 MB for ~3 MB of uint8 input), so the
# numpy path writes it once: the normalize runs on blocks of merge rows small enough to stay in
# the L2 cache, and each block is then stored next to its temporal copies.
_BLOCK_BYTES = 1 << 19


def _rows_numpy(frames: np.ndarray, cfg: PreprocessConfig) -> np.ndarray:
    n, height, width, c = frames.shape
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = height // p, width // p
    scale, bias = _affine(cfg)
    if n == 1:
        src = np.ascontiguousarray(frames[0].reshape(gh // m, m, p, gw // m, m, p, c).transpose(_IMAGE_PERM))
        out = np.empty((gh // m, gw // m, m, m, c, tp, p, p), dtype=np.float32)
        _normalize_blocks(src, out, scale.reshape(c, 1, 1), bias.reshape(c, 1, 1), temporal_axis=5)
    else:
        if pad := -n % tp:  # repeat the last frame
            frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
        gt = frames.shape[0] // tp
        src = np.ascontiguousarray(
            frames.reshape(gt, tp, gh // m, m, p, gw // m, m, p, c).transpose(_VIDEO_PERM)
        )  # [gt, gh/m, gw/m, m, m, C, tp, p, p] uint8
        src = src.reshape(gt * (gh // m), *src.shape[2:])  # merge rows of every frame pair
        out = np.empty(src.shape, dtype=np.float32)
        _normalize_blocks(src, out, scale.reshape(c, 1, 1, 1), bias.reshape(c, 1, 1, 1), temporal_axis=None)
    return out.reshape(-1, c * tp * p * p)  # [N, 3 * tp * p * p]


def _normalize_blocks(
    src: np.ndarray, out: np.ndarray, scale: np.ndarray, bias: np.ndarray, temporal_axis: int | None
) -> None:
    """``out = src * scale + bias`` block by block along axis 0 (merge rows).

    ``temporal_axis``: ``src`` lacks this axis of ``out`` (an image); every block is normalized
    once into a cache-sized scratch buffer and broadcast into all temporal copies.
    """
    row_bytes = 4 * src[0].size * (1 if temporal_axis is None else out.shape[temporal_axis])
    step = max(1, _BLOCK_BYTES // row_bytes)
    scratch = np.empty((min(step, len(src)), *src.shape[1:]), dtype=np.float32)
    for start in range(0, len(src), step):
        block = src[start : start + step]
        if temporal_axis is None:
            dst = out[start : start + step]
            np.multiply(block, scale, out=dst, dtype=np.float32)
            dst += bias  # still in cache
        else:
            norm = scratch[: len(block)]
            np.multiply(block, scale, out=norm, dtype=np.float32)
            norm += bias
            out[start : start + step] = np.expand_dims(norm, temporal_axis)  # one write per copy


@functools.cache
def _tables(cfg: PreprocessConfig) -> tuple[np.ndarray, np.ndarray]:
    """The C kernel's read-only tables: ``lut [C, 256]`` and ``affine [2, C]`` float32.

    ``lut[c, v]`` is every uint8 value normalized with the numpy path's exact arithmetic (a
    float32 multiply, then an add); ``affine`` is the scale and bias it was built from, for the
    kernel's SIMD path, which does that same arithmetic. One pair per config (frozen, hashable)."""
    scale, bias = _affine(cfg)
    values = np.arange(256, dtype=np.float32)[None, :]
    lut = np.ascontiguousarray(values * scale[:, None] + bias[:, None], dtype=np.float32)
    affine = np.ascontiguousarray(np.stack([scale, bias]), dtype=np.float32)
    for table in (lut, affine):
        table.setflags(write=False)
    return lut, affine


def _rows_c(frames: np.ndarray, cfg: PreprocessConfig, grid: tuple[int, int, int]) -> torch.Tensor:
    assert _c_kernel is not None
    n, height, width, stride = frames.shape  # stride 4: RGBX
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    out = torch.empty(grid[0] * grid[1] * grid[2], 3 * tp * p * p, dtype=torch.float32)  # [N, row]
    src = np.ascontiguousarray(frames)  # PIL's and PyAV's arrays already are: no copy
    lut, affine = _tables(cfg)
    _c_kernel.patchify(src, lut, affine, out.numpy(), n, height, width, 3, stride, p, m, tp)
    return out


def _rows_torch(frames: torch.Tensor, cfg: PreprocessConfig) -> torch.Tensor:
    n, height, width, c = frames.shape
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = height // p, width // p
    scale_np, bias_np = _affine(cfg)
    scale = torch.from_numpy(scale_np).to(frames.device).view(c, 1, 1, 1)  # broadcast over (tp, p, p)
    bias = torch.from_numpy(bias_np).to(frames.device).view(c, 1, 1, 1)
    if n == 1:
        src = frames[0].reshape(gh // m, m, p, gw // m, m, p, c).permute(_IMAGE_PERM).unsqueeze(5)
        rows = src.contiguous().to(torch.float32).mul_(scale).add_(bias)  # [gh/m, gw/m, m, m, C, 1, p, p]
        rows = rows.expand(-1, -1, -1, -1, -1, tp, -1, -1)
    else:
        if pad := -n % tp:  # repeat the last frame
            frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
        gt = frames.shape[0] // tp
        src = frames.reshape(gt, tp, gh // m, m, p, gw // m, m, p, c).permute(_VIDEO_PERM)
        rows = (
            src.contiguous().to(torch.float32).mul_(scale).add_(bias)
        )  # [gt, gh/m, gw/m, m, m, C, tp, p, p]
    return rows.reshape(-1, c * tp * p * p)  # [N, 3 * tp * p * p], contiguous
