"""Both backends against transformers' Qwen2-VL processors (PIL and torchvision variants).

Parity bar for every case: identical ``grid_thw``; mean |diff| <= 0.01 and max |diff| <= 0.15 in
normalized units (one uint8 level is ~0.015). Images are synthetic but camera-like: smooth colour
fields, hard-edged shapes, sensor noise and a lens-like blur (media_io.preprocess.synthetic).

The image, JPEG and video cases run under two configs (tests/media_io/configs.py): Qwen2-VL's
defaults, and MiMo-V2.5's (patch 16, merge 2, its pixel bounds and mean/std), the reference then
being the same transformers processors configured with those values. MiMo-V2.5's own reference
path is that processor through PIL (bicubic); sglang's bilinear resize is not followed.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from media_io.config import MediaLimits
from media_io.errors import BadMedia, MediaTooLarge
from media_io.image import decode_image, decode_image_sized
from media_io.preprocess import Patches, PreprocessBackend, get_backend
from media_io.preprocess.cpu import CpuBackend
from media_io.preprocess.synthetic import encode, synthetic_photo
from tests.media_io.configs import CONFIGS, QWEN2_VL, reference_kwargs

MEAN_TOL, MAX_TOL = 0.01, 0.15
BACKENDS = ["cpu", "dali"]

# (width, height): extremes near 200:1, portrait, 4K, and sizes that hit min_pixels / max_pixels.
SIZES = [
    (28, 28),  # tiny: scaled up to min_pixels (56x56)
    (100, 50),  # below min_pixels
    (2000, 10),  # exactly 200:1, landscape
    (11, 2000),  # ~182:1, portrait
    (3000, 16),  # ~188:1, sides below one patch
    (640, 480),
    (480, 640),  # portrait
    (333, 777),  # odd sides
    (1920, 1080),  # above max_pixels
    (1080, 1920),  # portrait, above max_pixels
    (1283, 1283),  # square, above max_pixels
    (3840, 2160),  # 4K UHD
    (4032, 3024),  # 12 Mpx phone photo
]


@cache
def photo(width: int, height: int) -> Image.Image:
    return synthetic_photo(width, height, seed=width * 7 + height)


@cache
def jpeg(width: int, height: int) -> bytes:
    return encode(photo(width, height))


@cache
def _processors(config: str) -> dict[str, Any]:
    kwargs = reference_kwargs(CONFIGS[config])
    return {"pil": Qwen2VLImageProcessorPil(**kwargs), "torchvision": Qwen2VLImageProcessor(**kwargs)}


def reference(img: Image.Image, kind: str = "pil", config: str = "qwen2_vl") -> Patches:
    out = _processors(config)[kind](images=img, return_tensors="pt")
    return Patches(out["pixel_values"], tuple(out["image_grid_thw"][0].tolist()))


@cache
def reference_for(width: int, height: int, kind: str, config: str) -> Patches:
    return reference(photo(width, height), kind, config)


def video_reference(frames: np.ndarray, config: str = "qwen2_vl") -> Patches:
    """transformers' ``Qwen2VLVideoProcessor`` configured like ``CONFIGS[config]`` on frames
    ``[T, H, W, 3]`` uint8, without the per-frame cap (``decode_video`` applies that)."""
    from transformers import Qwen2VLVideoProcessor

    out = Qwen2VLVideoProcessor(**reference_kwargs(CONFIGS[config], video=True))(
        videos=[torch.from_numpy(frames).permute(0, 3, 1, 2)], return_tensors="pt", cap_pixels_per_frame=False
    )
    return Patches(out["pixel_values_videos"], tuple(out["video_grid_thw"][0].tolist()))


def assert_parity(got: Patches, ref: Patches, mean_tol: float = MEAN_TOL, max_tol: float = MAX_TOL) -> None:
    assert got.grid_thw == ref.grid_thw
    assert got.pixel_values.shape == ref.pixel_values.shape
    assert got.pixel_values.dtype == torch.float32 and got.pixel_values.is_contiguous()
    diff = (got.pixel_values.cpu() - ref.pixel_values).abs()
    mean, peak = diff.mean().item(), diff.max().item()
    del diff  # up to 200 MB for a MiMo-V2.5 4K image
    assert mean <= mean_tol, f"mean |diff| {mean:.4f}"
    assert peak <= max_tol, f"max |diff| {peak:.4f}"


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind", ["pil", "torchvision"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("width", "height"), SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_image_parity(width: int, height: int, backend: str, kind: str, config: str) -> None:
    cfg = CONFIGS[config]
    got = get_backend(backend, cfg).image(photo(width, height))
    assert got.pixel_values.shape[1] == 3 * cfg.temporal_patch_size * cfg.patch_size**2  # 1176 / 1536
    assert_parity(got, reference_for(width, height, kind, config))


JPEG_SIZES = [(28, 28), (2000, 10), (640, 480), (333, 777), (1920, 1080), (3840, 2160), (4032, 3024)]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("width", "height"), JPEG_SIZES, ids=[f"{w}x{h}" for w, h in JPEG_SIZES])
def test_jpeg_bytes_parity_decode_included(width: int, height: int, backend: str, config: str) -> None:
    data = jpeg(width, height)
    # The reference decodes with Pillow at full size, as a client of transformers would.
    ref = reference(Image.open(io.BytesIO(data)), config=config)
    assert_parity(get_backend(backend, CONFIGS[config]).image_bytes(data, item="img"), ref)


def test_jpeg_draft_decodes_at_reduced_scale_only_when_target_fits() -> None:
    backend = CpuBackend()
    big = decode_image_sized(jpeg(4032, 3024), min_size=backend.target)
    assert big.image.size == (2016, 1512)  # 1/2 DCT scale; the target 1148x840 still fits
    assert big.full_size == (3024, 4032) and backend.target(*big.full_size) == (840, 1148)
    small = decode_image_sized(jpeg(1920, 1080), min_size=backend.target)
    assert small.image.size == (1920, 1080)  # 1/2 would undershoot the target 1316x728
    assert backend.target(*small.full_size) == (728, 1316)
    assert decode_image(jpeg(4032, 3024)).size == (4032, 3024)  # no hint: always full size


def test_exact_path_without_draft_on_harsh_content() -> None:
    # Unblurred noise and aliased edges are where a reduced IDCT differs most from bicubic:
    # with draft off the cpu backend equals the reference up to float rounding.
    img = synthetic_photo(2400, 1800, seed=5, noise=12.0, blur=0.0)
    data = encode(img)
    got = CpuBackend(jpeg_draft=False).image_bytes(data)
    assert_parity(got, reference(Image.open(io.BytesIO(data))), mean_tol=1e-6, max_tol=1e-5)


def _with_exif_orientation(img: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90, exif=exif)
    return buf.getvalue()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("width", "height"), [(640, 360), (2400, 1600)])  # plain and drafted decode
def test_exif_rotation_matches_upright_reference(backend: str, width: int, height: int) -> None:
    data = _with_exif_orientation(photo(width, height), 6)  # stored landscape, shown portrait
    upright = decode_image(data)
    assert upright.size == (height, width)
    got = get_backend(backend).image_bytes(data)
    assert got.grid_thw[1] > got.grid_thw[2]  # portrait grid
    assert_parity(got, reference(upright))


def _rgba_png() -> bytes:
    rgba = photo(320, 240).convert("RGBA")
    alpha = Image.linear_gradient("L").resize(rgba.size)
    rgba.putalpha(alpha)
    return encode(rgba, "PNG")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "make",
    [_rgba_png, lambda: encode(photo(300, 200), "GIF"), lambda: encode(photo(300, 200), "BMP")],
    ids=["png-rgba", "gif", "bmp"],
)
def test_non_jpeg_formats_match_reference(backend: str, make: Callable[[], bytes]) -> None:
    data = make()
    # The reference sees the undecoded-by-us file through Pillow (alpha composited on white).
    ref = reference(Image.open(io.BytesIO(data)))
    assert_parity(get_backend(backend).image_bytes(data), ref)


def test_dali_batched_equals_one_by_one() -> None:
    # Only DALI batches (one pipeline run per max_batch images); the cpu backend's ``images`` is a
    # loop over ``image`` by design (parallelism comes from executor threads), so it has no
    # batched path to check.
    be: PreprocessBackend = get_backend("dali")
    sizes = [
        (64, 48),
        (640, 480),
        (28, 28),
        (300, 90),
        (90, 300),
        (640, 480),
        (500, 500),
        (56, 56),
        (120, 40),
    ]
    imgs = [photo(w, h) for w, h in sizes]  # 9 images: more than one DALI batch of 8
    batched = be.images(imgs)
    assert len(batched) == len(imgs)
    for img, got in zip(imgs, batched, strict=True):
        one = be.image(img)
        assert got.grid_thw == one.grid_thw
        assert torch.equal(got.pixel_values, one.pixel_values)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs_raise_typed_errors_and_backend_survives(backend: str) -> None:
    be: PreprocessBackend = get_backend(backend)
    data = jpeg(640, 480)
    with pytest.raises(BadMedia, match="corrupt or truncated jpeg") as info:
        be.image_bytes(data[: len(data) // 2], item="images[1]")
    assert info.value.item == "images[1]"
    with pytest.raises(BadMedia, match="aspect ratio"):
        be.image(Image.new("RGB", (3000, 10)), item="wide")
    with pytest.raises(BadMedia, match="aspect ratio"):
        be.image_bytes(encode(Image.new("RGB", (10, 3000))), item="tall")
    with pytest.raises(MediaTooLarge):
        be.image_bytes(data, MediaLimits(max_image_pixels=640 * 480 - 1))
    # The next request is unaffected.
    assert_parity(be.image_bytes(data), reference(Image.open(io.BytesIO(data))))


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_frames", [3, 4])
def test_video_frames_at_target_are_not_resized(backend: str, num_frames: int, config: str) -> None:
    from media_io.preprocess.resize import video_frame_target

    cfg = CONFIGS[config]
    h, w = 11 * cfg.factor, 13 * cfg.factor  # Qwen2-VL 308x364, MiMo-V2.5 352x416
    frames = np.stack([np.asarray(photo(w, h + i))[:h] for i in range(num_frames)])  # [T, h, w, 3]
    assert video_frame_target(h, w, cfg) == (h, w)
    be: PreprocessBackend = get_backend(backend, cfg)
    got = be.video(frames)
    assert got.grid_thw == ((num_frames + 1) // 2, 22, 26)
    # Already at smart_resize's target, where the reference's resize changes nothing: the two agree
    # to the float rounding of the normalization (an odd T is padded by repeating the last frame).
    ref = video_reference(frames, config)
    assert ref.grid_thw == got.grid_thw
    torch.testing.assert_close(got.pixel_values.cpu(), ref.pixel_values, atol=1e-5, rtol=0)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_video_frames_off_target_are_resized_like_the_reference(backend: str, config: str) -> None:
    frames = np.stack([np.asarray(photo(320, 240 + i))[:240] for i in range(5)])  # [5, 240, 320, 3]
    got = get_backend(backend, CONFIGS[config]).video(frames)
    # Qwen2-VL: 76800 px is below video_min_pixels 100352, scaled up by sqrt(100352 / 76800) and
    # ceiled to 28: 280x392. MiMo-V2.5: rounded to 32 (7.5 -> 8 by banker's rounding): 256x320.
    assert got.grid_thw[1:] == {"qwen2_vl": (20, 28), "mimo_v25": (16, 20)}[config]
    assert_parity(got, video_reference(frames, config))


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize(("width", "height"), [(640, 480), (1920, 1080), (4032, 3024)])
def test_dali_gpu_nvjpeg_parity(width: int, height: int, config: str) -> None:
    from media_io.preprocess.dali import DaliBackend

    be = DaliBackend(CONFIGS[config], use_gpu=True)
    data = jpeg(width, height)
    got = be.image_bytes(data)
    assert got.pixel_values.is_cuda
    assert_parity(got, reference(Image.open(io.BytesIO(data)), config=config))
    frames = np.stack([np.asarray(photo(320, 240 + i))[:240] for i in range(3)])
    assert_parity(be.video(frames), video_reference(frames, config))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_frames", [1, 3])
def test_torch_patchify_on_cuda_equals_numpy(num_frames: int) -> None:
    from media_io.preprocess import patchify_uint8

    frames = torch.randint(0, 256, (num_frames, 56, 84, 3), dtype=torch.uint8)
    on_gpu = patchify_uint8(frames.cuda())
    assert on_gpu.pixel_values.is_cuda
    torch.testing.assert_close(on_gpu.pixel_values.cpu(), patchify_uint8(frames).pixel_values)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_video_frames_at_a_capped_target_are_kept(backend: str, config: str) -> None:
    # decode_video's per-frame cap shrinks with the frame count and may land below
    # video_min_pixels (Qwen2-VL: 252x336 = 84672 < 100352; MiMo-V2.5: 64x96 = 6144 < 8192):
    # such frames must not be scaled back up.
    cfg = CONFIGS[config]
    h, w = {"qwen2_vl": (252, 336), "mimo_v25": (64, 96)}[config]
    assert h * w < cfg.video_min_pixels
    frames = np.stack([np.asarray(photo(w, h + i))[:h] for i in range(2)])  # [2, h, w, 3]
    got = get_backend(backend, cfg).video(frames)
    assert got.grid_thw == (1, h // cfg.patch_size, w // cfg.patch_size)


def test_video_frame_target_rule() -> None:
    from media_io.preprocess.resize import smart_resize, video_frame_target

    cfg = QWEN2_VL
    assert video_frame_target(252, 336, cfg) == (252, 336)  # at a (capped) target already
    assert video_frame_target(1008, 1792, cfg) == smart_resize(
        1008, 1792, 28, cfg.video_min_pixels, cfg.video_max_pixels
    )
    assert video_frame_target(1008, 1792, cfg) != (1008, 1792)  # multiples of 28 but over the cap
    assert video_frame_target(720, 1280, cfg) == smart_resize(
        720, 1280, 28, cfg.video_min_pixels, cfg.video_max_pixels
    )
