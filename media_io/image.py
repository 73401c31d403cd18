"""Decode image bytes to an upright 8-bit RGB ``PIL.Image`` (synchronous; run it in an executor).

Steps, each with its own typed error:

1. ``sniff`` the magic bytes: only jpeg, png, webp, gif and bmp go on, and Pillow is told which
   single format to use (no guessing through every plugin it has).
2. ``Image.open`` reads only the header: the pixel count is checked against
   ``MediaLimits.max_image_pixels`` *before* any pixel is decoded, so a 30000x30000 PNG or a
   65535x65535 GIF costs a few bytes of parsing, not gigabytes. Pillow's own bomb check
   (``DecompressionBombError``) is mapped to MediaTooLarge as well.
3. ``load`` decodes; truncated or corrupt data is BadMedia naming the item. Animated GIF/WebP:
   the first frame only.
4. EXIF orientation is applied, then the mode is made RGB. Upright images (orientation 1 or no
   EXIF) are returned as decoded: ``ImageOps.exif_transpose`` would copy them, which costs about
   as much as the decode itself at 1080p.

Reduced-scale JPEG decode (``min_size``): a caller that will shrink the image anyway (the cpu
preprocessing backend) passes ``min_size(height, width) -> (min_height, min_width)``, the size the
image must keep, computed from the *full-resolution, upright* size. libjpeg then runs a reduced
IDCT at 1/2, 1/4 or 1/8 scale (Pillow's ``Image.draft``) when even 1/2 stays at least that size:

   original 4032x3024 --draft 1/2 (IDCT 4x4)--> 2016x1512   (target 1148x840 fits in 1/2)
   original 1920x1080 --no draft---------------> 1920x1080   (target 1316x728 > 960x540)

The reduced IDCT is a slightly different low-pass than a bicubic antialias filter (measured in
the parity tests: mean |diff| ~0.003, max ~0.11 normalized units after resizing). Other formats
ignore the hint. ``decode_image_sized`` also returns the full upright size, so the caller's grid
is the reference's even when the pixels came out smaller.

Colour conversion follows what ``Qwen2VLImageProcessor`` does (transformers'
``convert_to_rgb``), so feeding our output to the reference processor changes nothing:
images with an alpha band or a palette/``transparency`` entry are alpha-composited onto
**white**; everything else goes through Pillow's ``convert("RGB")`` (CMYK, L, 1, YCbCr, ...).
One deliberate difference: 16-bit and 32-bit integer greyscale (``I;16*``, ``I``) are scaled to
8 bits (``v >> 8``) instead of Pillow's conversion, which clips every value above 255 and turns
a normal 16-bit photo almost white.

This module knows nothing of fetching or preprocessing.
"""

from __future__ import annotations

import contextlib
import io
import struct
import zlib
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from media_io.config import MediaLimits
from media_io.errors import BadMedia, MediaTooLarge, UnsupportedMedia
from media_io.sniff import sniff

_PIL_FORMAT = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "gif": "GIF", "bmp": "BMP"}
# What a corrupt file can make Pillow's decoders raise, besides OSError.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error)


SizeHint = Callable[[int, int], tuple[int, int]]
"""``(height, width) -> (min_height, min_width)``: the full upright size to the size the decoded
image must keep on both sides (e.g. a ``smart_resize`` target). May raise a MediaError."""

# EXIF orientations that swap width and height (rotations by 90 or 270 degrees).
_TRANSPOSING_ORIENTATIONS = frozenset({5, 6, 7, 8})
_EXIF_ORIENTATION_TAG = 0x0112


class DecodedImage(NamedTuple):
    """An upright RGB image and the upright size of the stored image before any DCT scaling."""

    image: Image.Image  # RGB; smaller than full_size only after a JPEG draft, never below the hint
    full_size: tuple[int, int]  # (height, width) at full resolution, after EXIF rotation


def decode_image(
    data: bytes,
    limits: MediaLimits = MediaLimits(),
    item: str | None = None,
    *,
    min_size: SizeHint | None = None,
) -> Image.Image:
    """Decode ``data`` to an RGB image, EXIF-rotated, with the pixel cap checked before decoding.

    ``min_size`` allows a reduced-scale JPEG decode (see the module docstring); without it the
    image is always at full resolution.

    Raises BadMedia (empty, truncated, corrupt), UnsupportedMedia (not jpeg/png/webp/gif/bmp,
    video bytes, HTML), MediaTooLarge (over ``limits.max_bytes`` or ``limits.max_image_pixels``),
    and whatever ``min_size`` raises.
    """
    return decode_image_sized(data, limits, item, min_size=min_size).image


def decode_image_sized(
    data: bytes,
    limits: MediaLimits = MediaLimits(),
    item: str | None = None,
    *,
    min_size: SizeHint | None = None,
) -> DecodedImage:
    """``decode_image`` plus the full upright ``(height, width)``, for callers that pass ``min_size``."""
    img, fmt = open_header(data, limits, item)
    width, height = img.size  # as stored, before any rotation
    if fmt == "jpeg" and min_size is not None:
        # JPEG's EXIF sits in APP1, before the pixels: the orientation is known before decoding.
        transposed = orientation(img) in _TRANSPOSING_ORIENTATIONS
        _draft(img, min_size(*((width, height) if transposed else (height, width))), transposed)
    try:
        img.load()  # the full decode (first frame of an animation)
        decoded_size = img.size  # smaller than (width, height) after a draft
        rgb = to_rgb(_upright(img))
    except Image.DecompressionBombError as exc:
        raise MediaTooLarge(f"{fmt} image refused by the decompression-bomb check: {exc}", item) from exc
    except _DECODE_ERRORS as exc:
        raise BadMedia(f"corrupt or truncated {fmt} image: {_reason(exc)}", item) from exc
    # Whether the rotation really happened (corrupt EXIF may stop it), read off the result.
    turned = rgb.size != decoded_size
    return DecodedImage(rgb, (width, height) if turned else (height, width))


def _draft(img: Image.Image, target: tuple[int, int], transposed: bool) -> None:
    """Ask libjpeg for the smallest 1/s scale (s in 8, 4, 2) that keeps the upright ``target``."""
    target_h, target_w = target
    # Pillow takes the request as (width, height) of the stored, pre-rotation image.
    request = (target_h, target_w) if transposed else (target_w, target_h)
    width, height = img.size
    if 2 * request[0] > width or 2 * request[1] > height:
        return  # even 1/2 would undershoot: decode at full size
    img.draft(img.mode, request)


def image_format(data: bytes, limits: MediaLimits, item: str | None) -> str:
    """The format name of image bytes, from their magic bytes, with the byte cap enforced.

    Raises like ``decode_image`` for what the first bytes tell (too large, not an image, video).
    """
    if len(data) > limits.max_bytes:
        raise MediaTooLarge(f"image is {len(data)} bytes, over the {limits.max_bytes}-byte limit", item)
    try:
        kind = sniff(data)
    except (BadMedia, UnsupportedMedia) as exc:
        raise type(exc)(exc.message, item) from exc
    if kind.modality != "image":
        raise UnsupportedMedia(f"expected an image, got {kind.format} {kind.modality}", item)
    return kind.format


def open_header(data: bytes, limits: MediaLimits, item: str | None) -> tuple[Image.Image, str]:
    """``image_format``, then parse only the header, with the pixel cap enforced.

    Returns the lazily opened image (nothing decoded yet) and its format name. Raises like
    ``decode_image`` for everything that can be told before the pixels.
    """
    fmt = image_format(data, limits, item)
    return _open_header(data, fmt, limits, item), fmt


def orientation(img: Image.Image) -> int:
    """The EXIF orientation (1 when absent or unreadable: corrupt EXIF loses only the rotation)."""
    try:
        value = img.getexif().get(_EXIF_ORIENTATION_TAG, 1)
    except _DECODE_ERRORS:
        return 1
    return value if isinstance(value, int) else 1


def _open_header(data: bytes, fmt: str, limits: MediaLimits, item: str | None) -> Image.Image:
    """Parse only the header and enforce the pixel cap (Image.open is lazy)."""
    try:
        # Pillow's own bomb check runs here and raises above 2 * Image.MAX_IMAGE_PIXELS. (Its
        # warning above 1x is left alone: warnings filters are process-global, not thread-safe.)
        img = Image.open(io.BytesIO(data), formats=[_PIL_FORMAT[fmt]])
    except Image.DecompressionBombError as exc:
        raise MediaTooLarge(f"{fmt} image refused by the decompression-bomb check: {exc}", item) from exc
    except UnidentifiedImageError as exc:
        raise BadMedia(f"corrupt {fmt} image: the header could not be parsed", item) from exc
    except _DECODE_ERRORS as exc:
        raise BadMedia(f"corrupt {fmt} image header: {_reason(exc)}", item) from exc
    width, height = img.size
    if width <= 0 or height <= 0:
        raise BadMedia(f"{fmt} image has an empty size {width}x{height}", item)
    if width * height > limits.max_image_pixels:
        raise MediaTooLarge(
            f"{fmt} image is {width}x{height} = {width * height} pixels, over the "
            f"{limits.max_image_pixels}-pixel limit",
            item,
        )
    return img


def _upright(img: Image.Image) -> Image.Image:
    """Apply the EXIF orientation (after ``load``: PNG may keep EXIF behind the pixels).

    Upright images are returned as they are, without ``exif_transpose``'s full copy. Corrupt
    EXIF only loses the rotation, not the image.
    """
    if orientation(img) not in range(2, 9):
        return img
    with contextlib.suppress(*_DECODE_ERRORS):
        return ImageOps.exif_transpose(img)
    return img


def to_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB, with transparency composited onto white (see the module docstring)."""
    if img.mode == "RGB":
        return img
    if img.mode in ("I", "F") or img.mode.startswith("I;16"):
        return _wide_grey_to_rgb(img)
    if "A" in img.getbands() or "transparency" in img.info:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _wide_grey_to_rgb(img: Image.Image) -> Image.Image:
    arr = np.asarray(img)  # [H, W], uint16 / int32 / float32
    if img.mode == "F":
        grey = np.clip(arr, 0, 255).astype(np.uint8)  # float images are taken as already 0..255
    else:
        grey = (np.clip(arr.astype(np.int64), 0, 0xFFFF) >> 8).astype(np.uint8)
    return Image.fromarray(np.repeat(grey[:, :, None], 3, axis=2))  # [H, W, 3]


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
