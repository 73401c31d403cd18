"""Patch estimates before decoding: an image's equal the grid its preprocessing produces; a
video's follow the videos seen; what a header cannot say falls back instead of failing."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from media_io.config import PreprocessConfig
from media_io.preprocess import get_backend
from media_io.work_estimate import PatchEstimator, image_patches
from tests.media_io.bad_media import png_bomb

QWEN = PreprocessConfig()
MIMO = PreprocessConfig(patch_size=16)  # factor 32


def encoded(width: int, height: int, fmt: str, orientation: int | None = None) -> bytes:
    rng = np.random.default_rng(width * 7 + height)
    img = Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))
    buf = io.BytesIO()
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        img.save(buf, fmt, exif=exif)
    else:
        img.save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize("cfg", [QWEN, MIMO], ids=["factor28", "factor32"])
@pytest.mark.parametrize(
    ("width", "height", "fmt"),
    [
        (56, 56, "PNG"),
        (320, 240, "JPEG"),
        (1000, 37, "PNG"),
        (1920, 1080, "JPEG"),
        (333, 777, "WEBP"),
        (64, 48, "GIF"),
    ],
)
def test_an_image_estimate_is_the_grid_its_preprocessing_produces(
    cfg: PreprocessConfig, width: int, height: int, fmt: str
) -> None:
    data = encoded(width, height, fmt)
    assert image_patches(data, cfg) == get_backend("cpu", cfg).image_bytes(data).num_patches


def test_headers_that_say_nothing_fall_back() -> None:
    est = PatchEstimator(QWEN)
    assert image_patches(b"\xff\xd8\xff\xe0 not really a jpeg", QWEN) is None
    assert image_patches(png_bomb(), QWEN) is None  # Pillow refuses it at open; so will the decode
    fallback = est.estimate(b"\x89PNG\r\n\x1a\n truncated", "image")
    assert fallback == QWEN.min_pixels / QWEN.patch_size**2
    est.observe("image", 400)
    assert est.estimate(b"\x89PNG\r\n\x1a\n truncated", "image") == 400


def test_a_video_estimate_is_the_recent_mean() -> None:
    est = PatchEstimator(QWEN)
    seed = est.estimate(b"", "video")
    assert seed == 8 * QWEN.video_min_pixels // QWEN.patch_size**2
    est.observe("video", 1000)
    est.observe("video", 3000)
    assert est.estimate(b"", "video") == 2000
