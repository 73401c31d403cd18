"""pillow_pixels: Pillow's own memory as a numpy view, or a copy where it cannot be viewed."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from media_io.preprocess.pillow_pixels import pillow_pixels


def _image(width: int, height: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(width * height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)


@pytest.mark.parametrize("size", [(644, 476), (28, 28), (1, 300), (1316, 728)])
def test_rgb_images_are_viewed_in_place(size: tuple[int, int]) -> None:
    img = _image(*size)
    with pillow_pixels(img) as pixels:
        assert pixels.shape == (size[1], size[0], 4) and pixels.dtype == np.uint8
        assert not pixels.flags.owndata  # a view, not a copy
        assert np.array_equal(pixels[..., :3], np.asarray(img))


def test_rgbx_is_viewed_and_resized_images_too() -> None:
    img = _image(640, 480).resize((644, 476), Image.Resampling.BICUBIC).convert("RGBX")
    with pillow_pixels(img) as pixels:
        assert np.array_equal(pixels, np.asarray(img))


def test_what_cannot_be_viewed_is_copied() -> None:
    grey = _image(64, 48, "L")
    with pillow_pixels(grey) as pixels:
        assert np.array_equal(pixels, np.asarray(grey))
    memory = np.arange(48 * 64 * 4, dtype=np.uint8)
    mapped = Image.frombuffer("RGBX", (64, 48), memory, "raw", "RGBX", 0, 1)  # outside memory
    with pillow_pixels(mapped) as pixels:
        assert np.array_equal(pixels, memory.reshape(48, 64, 4))
    big = Image.new("RGB", (4096, 2048), (1, 2, 3))  # 32 MiB: more than one 16 MiB memory block
    with pillow_pixels(big) as pixels:
        assert pixels.shape == (2048, 4096, 3) and (pixels[-1, -1] == (1, 2, 3)).all()
