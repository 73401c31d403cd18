"""Decode image bytes for preprocessing, letting libjpeg downscale in the DCT domain when it can.

A 4032x3024 photo ends up as about 1148x840 pixels. Decoding all 12 Mpx and then resizing costs
most of the time; libjpeg can instead run a reduced IDCT that yields a 1/2, 1/4 or 1/8 scale
image directly (Pillow's ``Image.draft``), several times faster. We only ask for a scale whose
result is still at least the target size on both sides, then the usual bicubic resize follows.

   original 4032x3024 --draft 1/2 (IDCT 4x4)--> 2016x1512 --bicubic, antialias--> 1148x840
   original 1920x1080 --no draft (target 1316x728 > 1/2 scale)------------------> 1316x728

The reduced IDCT is a slightly different low-pass than a bicubic antialias filter, so values at
sharp, pixel-level detail move a little (measured in the parity tests: mean |diff| ~0.003 and
max ~0.11 normalized units on camera-like images). Pass ``draft=False`` for the exact path.

JPEGs take this module's path (with or without a draft); it does what
``media_io.image.decode_image`` does (format sniffing, pixel cap before decoding, EXIF
rotation, RGB conversion with ``to_rgb``) minus one full-image copy: ``ImageOps.exif_transpose``
copies even an already upright image, which costs about as much as the decode itself at
1080p. Anything unusual about the header, and every other format, goes to ``decode_image``,
so its typed errors are raised in one place.
"""

from __future__ import annotations

import contextlib
import io
import struct
import zlib
from collections.abc import Callable

from PIL import Image, ImageOps

from media_io.config import MediaLimits
from media_io.errors import BadMedia, MediaError, MediaTooLarge
from media_io.image import decode_image, to_rgb
from media_io.sniff import sniff

# EXIF orientations that swap width and height (rotations by 90 or 270 degrees).
_TRANSPOSING_ORIENTATIONS = frozenset({5, 6, 7, 8})
_EXIF_ORIENTATION_TAG = 0x0112
# What a corrupt JPEG can make Pillow raise (the same set media_io.image maps to BadMedia).
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error)

TargetFn = Callable[[int, int], tuple[int, int]]
"""``(height, width) -> (target_height, target_width)``, e.g. a ``smart_resize`` partial."""


def decode_for_target(
    data: bytes,
    target_fn: TargetFn,
    limits: MediaLimits = MediaLimits(),
    item: str | None = None,
    draft: bool = True,
) -> tuple[Image.Image, tuple[int, int]]:
    """Decode ``data`` to upright RGB, possibly at a reduced JPEG scale, plus the resize target.

    ``target_fn(height, width) -> (target_h, target_w)`` maps the *full-resolution, upright*
    size to the size the image must be resized to (``smart_resize``). It is computed from the
    original size, never the drafted one, so the grid is the reference's.

    Returns ``(image, (target_h, target_w))``; the image is at least the target size on both sides
    whenever drafting happened. Raises what ``decode_image`` raises (MediaError subclasses).
    """
    if _is_jpeg(data) and len(data) <= limits.max_bytes:
        decoded = _decode_jpeg(data, target_fn, limits, item, draft)
        if decoded is not None:
            return decoded
    img = decode_image(data, limits, item)
    return img, target_fn(img.height, img.width)


def _is_jpeg(data: bytes) -> bool:
    try:
        return sniff(data).format == "jpeg"
    except MediaError:
        return False  # decode_image raises the proper error


def _decode_jpeg(
    data: bytes, target_fn: TargetFn, limits: MediaLimits, item: str | None, draft: bool
) -> tuple[Image.Image, tuple[int, int]] | None:
    """The JPEG path, or None when the header looks wrong (then ``decode_image`` decides)."""
    try:
        img = Image.open(io.BytesIO(data), formats=["JPEG"])
        width, height = img.size
        orientation = img.getexif().get(_EXIF_ORIENTATION_TAG, 1)
    except (*_DECODE_ERRORS, Image.DecompressionBombError):
        return None  # header trouble: decode_image raises the typed error
    if width <= 0 or height <= 0 or width * height > limits.max_image_pixels:
        return None
    transposed = orientation in _TRANSPOSING_ORIENTATIONS
    up_h, up_w = (width, height) if transposed else (height, width)
    target_h, target_w = target_fn(up_h, up_w)  # may raise BadMedia (aspect ratio)
    # A DCT scale only helps when even 1/2 stays at or above the target. Draft is asked in the
    # stored (pre-rotation) orientation; Pillow picks the smallest scale 1/s (s in 8, 4, 2)
    # whose result is still >= the requested size on both sides, and keeps the mode.
    use_draft = draft and 2 * target_h <= up_h and 2 * target_w <= up_w
    request = (target_h, target_w) if transposed else (target_w, target_h)  # (width, height)
    try:
        if use_draft:
            img.draft(img.mode, request)
        img.load()
    except Image.DecompressionBombError as exc:
        raise MediaTooLarge(f"jpeg image refused by the decompression-bomb check: {exc}", item) from exc
    except _DECODE_ERRORS as exc:
        raise BadMedia(f"corrupt or truncated jpeg image: {type(exc).__name__}: {exc}", item) from exc
    upright: Image.Image = img
    if orientation != 1:  # upright images are used as decoded, without exif_transpose's copy
        with contextlib.suppress(*_DECODE_ERRORS):  # corrupt EXIF loses only the rotation
            upright = ImageOps.exif_transpose(img)
    rgb = to_rgb(upright)
    assert not use_draft or (rgb.height >= target_h and rgb.width >= target_w), (
        rgb.size,
        (target_w, target_h),
    )
    return rgb, (target_h, target_w)
