"""The ``cpu`` backend: libjpeg or Pillow(-SIMD) decode, Pillow-SIMD resize, C normalize + patchify.

Per image:  bytes --JPEG: media_io.jpeg (libjpeg into a reused per-thread buffer, 1/2..1/8 IDCT
                   scaling when the target allows); other formats, CMYK, EXIF rotation, corrupt
                   data: media_io.image (Pillow)--> RGB(X) PIL image
                 --Image.resize(BICUBIC; Pillow's filter is antialiased)--> target size
                 --uint8 [1, H, W, 4] view of Pillow's memory--> patchify_uint8 (one C pass: normalize,
                   patch order)

No float64 anywhere and no Python loop over patches. Every step is single-threaded and releases
the GIL (libjpeg and Pillow's decode/resize, the patchify kernel), so throughput scales by
running images in several executor threads, without fighting a model for torch's intra-op pool.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
from PIL import Image

from media_io.config import MediaLimits, PreprocessConfig
from media_io.errors import BadMedia
from media_io.image import decode_image_sized, to_rgb
from media_io.jpeg import decode_jpeg_reusing
from media_io.preprocess.patchify import Patches, patchify_uint8
from media_io.preprocess.pillow_pixels import pillow_pixels
from media_io.preprocess.resize import smart_resize, video_frame_target


class CpuBackend:
    """Preprocessing on the CPU; see ``PreprocessBackend`` for the contract.

    ``jpeg_draft`` lets libjpeg decode large JPEGs at 1/2, 1/4 or 1/8 scale when the target is at
    most half the size (see ``media_io.jpeg``); ``False`` decodes at full size like the reference.
    """

    name = "cpu"

    def __init__(self, cfg: PreprocessConfig = PreprocessConfig(), jpeg_draft: bool = True) -> None:
        self.cfg = cfg
        self.jpeg_draft = jpeg_draft

    def target(self, height: int, width: int, item: str | None = None) -> tuple[int, int]:
        """``smart_resize`` target ``(height, width)`` of an image under this config."""
        c = self.cfg
        return smart_resize(height, width, c.factor, c.min_pixels, c.max_pixels, item=item)

    def image(self, img: Image.Image, item: str | None = None) -> Patches:
        img = to_rgb(img)
        return self._resized_patches(img, self.target(img.height, img.width, item))

    def images(self, imgs: Sequence[Image.Image]) -> list[Patches]:
        # Sequential on purpose: callers that want image-level parallelism run several images
        # in executor threads (every step releases the GIL).
        return [self.image(img, item=str(i)) for i, img in enumerate(imgs)]

    def image_bytes(
        self, data: bytes, limits: MediaLimits = MediaLimits(), item: str | None = None
    ) -> Patches:
        target_fn = functools.partial(self.target, item=item)
        # The target is the decode's size hint (JPEG DCT scaling) and is computed from the full
        # upright size, so the grid is the reference's whatever scale libjpeg decoded at.
        hint = target_fn if self.jpeg_draft else _full_size
        fast = decode_jpeg_reusing(data, limits, item, min_size=hint)  # None: not for the fast path
        if fast is not None:
            return self._resized_patches(fast.image, target_fn(*fast.full_size))
        decoded = decode_image_sized(data, limits, item, min_size=hint)
        return self._resized_patches(decoded.image, target_fn(*decoded.full_size))

    def video(self, frames: np.ndarray, item: str | None = None) -> Patches:
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[0] == 0:
            raise BadMedia(
                f"video frames must be a non-empty [T, H, W, 3] uint8 array, got {frames.dtype} {frames.shape}",
                item,
            )
        _, height, width, _ = frames.shape
        th, tw = video_frame_target(height, width, self.cfg, item)
        if (th, tw) != (height, width):
            frames = np.stack([np.asarray(_resize(Image.fromarray(f), th, tw)) for f in frames])
        return patchify_uint8(frames, self.cfg)

    def _resized_patches(self, img: Image.Image, target: tuple[int, int]) -> Patches:
        """``img`` (RGB, or RGBX from the fast JPEG path) resized to ``target``, then patchified."""
        th, tw = target
        img = _resize(img, th, tw)
        with pillow_pixels(img) as pixels:  # [H, W, 4] view of Pillow's memory, else a copy
            return patchify_uint8(pixels[None], self.cfg)


def _full_size(height: int, width: int) -> tuple[int, int]:
    """A decode size hint that keeps every pixel (no DCT scaling)."""
    return height, width


def _resize(img: Image.Image, height: int, width: int) -> Image.Image:
    """Bicubic resize to ``height x width``; Pillow widens the kernel when downscaling (antialias)."""
    if img.size == (width, height):
        return img
    return img.resize((width, height), Image.Resampling.BICUBIC)
