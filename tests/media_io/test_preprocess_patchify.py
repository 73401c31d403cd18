"""patchify_uint8: the row layout of transformers' Qwen2-VL processors, bit for bit, for Qwen2-VL's
patch 14 and MiMo-V2.5's patch 16 (and the C kernel's general loop for other sides)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import Qwen2VLVideoProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from media_io.config import PreprocessConfig
from media_io.preprocess import patchify_uint8
from media_io.preprocess.patchify import C_KERNEL_AVAILABLE
from tests.media_io.configs import CONFIGS, reference_kwargs

CFG = CONFIGS["qwen2_vl"]


def _frames(t: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (t, h, w, 3), dtype=torch.uint8, generator=g)  # [T, H, W, 3]


needs_c = pytest.mark.skipif(not C_KERNEL_AVAILABLE, reason="the C kernel was not built")
IMPLS = [pytest.param("c", marks=needs_c), "numpy", "torch"]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("channels", [3, 4])  # RGB, and Pillow's RGBX (the C kernel's SIMD path)
def test_image_rows_equal_transformers_pil_processor(impl: str, config: str, channels: int) -> None:
    cfg = CONFIGS[config]
    img = _frames(1, 3 * cfg.factor, 5 * cfg.factor)  # Qwen2-VL 84x140, MiMo-V2.5 96x160
    ref = Qwen2VLImageProcessorPil(**reference_kwargs(cfg))(
        images=img[0].numpy(), do_resize=False, return_tensors="pt"
    )
    pixels = torch.cat([img, torch.zeros_like(img[..., :1])], dim=-1) if channels == 4 else img
    out = patchify_uint8(pixels, cfg, impl=impl)
    assert out.grid_thw == tuple(ref["image_grid_thw"][0].tolist()) == (1, 6, 10)
    assert out.pixel_values.shape == (60, {"qwen2_vl": 1176, "mimo_v25": 1536}[config])
    assert out.pixel_values.dtype == torch.float32 and out.pixel_values.is_contiguous()
    torch.testing.assert_close(out.pixel_values, ref["pixel_values"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_frames", [1, 2, 3, 4, 5])
def test_video_rows_equal_transformers_video_processor(num_frames: int, impl: str, config: str) -> None:
    cfg = CONFIGS[config]
    frames = _frames(num_frames, 2 * cfg.factor, 3 * cfg.factor, seed=num_frames)
    ref = Qwen2VLVideoProcessor(**reference_kwargs(cfg, video=True))(
        videos=[frames.permute(0, 3, 1, 2)], do_resize=False, return_tensors="pt", cap_pixels_per_frame=False
    )
    out = patchify_uint8(frames, cfg, impl=impl)
    # Odd frame counts are padded by repeating the last frame: t = ceil(T / 2).
    assert out.grid_thw == tuple(ref["video_grid_thw"][0].tolist()) == ((num_frames + 1) // 2, 4, 6)
    torch.testing.assert_close(out.pixel_values, ref["pixel_values_videos"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_every_four_rows_are_one_2x2_merge_group(impl: str) -> None:
    # Encode each pixel's patch coordinates in its value so the layout can be read back.
    p, h, w = CFG.patch_size, 4, 6  # grid in patches
    ys, xs = np.meshgrid(np.arange(h * p) // p, np.arange(w * p) // p, indexing="ij")  # [H, W]
    img = np.stack([ys, xs, np.zeros_like(ys)], axis=-1).astype(np.uint8)[None]  # [1, H, W, 3]
    rows = patchify_uint8(
        torch.from_numpy(img), PreprocessConfig(image_mean=(0, 0, 0), image_std=(1, 1, 1)), impl
    )
    vals = (rows.pixel_values * 255).round().long().view(h * w, 3, 2, p, p)  # [N, C, T, p, p]
    # Every row is one constant patch, repeated over the temporal axis.
    assert (vals == vals[:, :, :1, :1, :1]).all()
    py, px = vals[:, 0, 0, 0, 0], vals[:, 1, 0, 0, 0]  # [N] patch coordinates of each row
    for g in range(h * w // 4):
        gy, gx = py[4 * g : 4 * g + 4], px[4 * g : 4 * g + 4]
        # The four rows of a group are the 2x2 block at (2i, 2j), in row-major order.
        assert gy.tolist() == [gy[0], gy[0], gy[0] + 1, gy[0] + 1] and gy[0] % 2 == 0
        assert gx.tolist() == [gx[0], gx[0] + 1, gx[0], gx[0] + 1] and gx[0] % 2 == 0
    # Groups are ordered row-major over the merged grid.
    assert [(int(py[4 * g]) // 2, int(px[4 * g]) // 2) for g in range(h * w // 4)] == [
        (i, j) for i in range(h // 2) for j in range(w // 2)
    ]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("mean", "std"),
    [
        ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
        ((0.5, 0.25, 0.0), (0.5, 1.0, 2.0)),
    ],
    ids=["clip", "other"],
)
def test_normalization_uses_the_config_mean_std(
    impl: str, mean: tuple[float, ...], std: tuple[float, ...]
) -> None:
    cfg = dataclasses.replace(CONFIGS["mimo_v25"], image_mean=mean, image_std=std)
    img = torch.full((1, 32, 32, 3), 255, dtype=torch.uint8)
    rows = patchify_uint8(img, cfg, impl).pixel_values.view(-1, 3, 2 * 16 * 16)  # [N, C, T*p*p]
    expected = torch.tensor([(1.0 - m) / s for m, s in zip(mean, std, strict=True)])
    torch.testing.assert_close(rows[0, :, 0], expected)
    assert torch.equal(rows, rows[:1, :, :1].expand_as(rows))


def test_numpy_input_equals_tensor_input() -> None:
    frames = _frames(3, 28, 56, seed=9)
    readonly = frames.numpy().copy()
    readonly.setflags(write=False)  # Pillow's buffers are read-only; they must be accepted as is
    a, b = patchify_uint8(frames, CFG), patchify_uint8(readonly, CFG)
    assert a.grid_thw == b.grid_thw == (2, 2, 4)
    assert torch.equal(a.pixel_values, b.pixel_values)


@needs_c
@pytest.mark.parametrize("channels", [3, 4])  # RGB and RGBX: each has its own loops in the kernel
# 14 and 16 have unrolled (RGBX: SSE4.1) loops; 8, 15 and 32 take the general one.
@pytest.mark.parametrize(("patch", "merge"), [(14, 2), (16, 2), (8, 2), (15, 2), (16, 1), (16, 3), (32, 2)])
@pytest.mark.parametrize(("t", "gh", "gw"), [(1, 1, 1), (1, 2, 9), (2, 3, 1), (3, 1, 3), (5, 2, 2)])
def test_c_kernel_is_bit_identical_to_numpy(
    t: int, gh: int, gw: int, patch: int, merge: int, channels: int
) -> None:
    cfg = dataclasses.replace(CFG, patch_size=patch, merge_size=merge)
    h, w = gh * cfg.factor, gw * cfg.factor  # sides in merge units
    rgb = _frames(t, h, w, seed=t * h + w).numpy()
    frames = np.concatenate([rgb, np.full((t, h, w, 1), 9, np.uint8)], axis=3) if channels == 4 else rgb
    c, ref = patchify_uint8(frames, cfg, "c"), patchify_uint8(rgb, cfg, "numpy")
    assert c.grid_thw == ref.grid_thw == (-(-t // 2), h // patch, w // patch)
    assert c.pixel_values.shape[1] == 3 * 2 * patch * patch
    assert c.pixel_values.is_contiguous() and torch.equal(c.pixel_values, ref.pixel_values)


def test_auto_falls_back_to_numpy_past_the_c_kernel_patch_limit() -> None:
    cfg = dataclasses.replace(CFG, patch_size=40, merge_size=1)  # 1600 floats per block > 1024
    frames = _frames(1, 80, 40).numpy()
    assert torch.equal(
        patchify_uint8(frames, cfg).pixel_values, patchify_uint8(frames, cfg, "numpy").pixel_values
    )


@needs_c
def test_c_kernel_takes_strided_input() -> None:
    wide = _frames(1, 56, 112, seed=3).numpy()
    view = wide[:, :, 28:84]  # not C-contiguous: copied before the kernel reads it
    assert torch.equal(
        patchify_uint8(view, CFG, "c").pixel_values, patchify_uint8(view, CFG, "numpy").pixel_values
    )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t", [1, 3])
def test_rgbx_input_ignores_the_fourth_byte(impl: str, t: int) -> None:
    rgb = _frames(t, 56, 84, seed=11).numpy()
    rgbx = np.concatenate([rgb, np.full((*rgb.shape[:3], 1), 77, np.uint8)], axis=3)  # Pillow's RGB layout
    a, b = patchify_uint8(rgbx, CFG, impl=impl), patchify_uint8(rgb, CFG, impl="numpy")
    assert a.grid_thw == b.grid_thw
    assert torch.equal(a.pixel_values, b.pixel_values)


@needs_c
def test_c_kernel_rejects_a_buffer_of_the_wrong_size() -> None:
    from media_io.preprocess import _patchify

    frames = np.zeros((1, 28, 28, 3), np.uint8)
    lut, affine = np.zeros((3, 256), np.float32), np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="out buffer size"):
        _patchify.patchify(frames, lut, affine, np.zeros(10, np.float32), 1, 28, 28, 3, 3, 14, 2, 2)
    with pytest.raises(ValueError, match="frames buffer size"):
        _patchify.patchify(frames, lut, affine, np.zeros((4, 1176), np.float32), 1, 56, 28, 3, 3, 14, 2, 2)
    with pytest.raises(ValueError, match="affine"):
        _patchify.patchify(
            frames, lut, affine[:1], np.zeros((4, 1176), np.float32), 1, 28, 28, 3, 3, 14, 2, 2
        )
