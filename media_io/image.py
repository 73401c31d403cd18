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
4. EXIF orientation is applied (``ImageOps.exif_transpose``), then the mode is made RGB.

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

import io
import struct
import zlib

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from media_io.config import MediaLimits
from media_io.errors import BadMedia, MediaTooLarge, UnsupportedMedia
from media_io.sniff import sniff

_PIL_FORMAT = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "gif": "GIF", "bmp": "BMP"}
# What a corrupt file can make Pillow's decoders raise, besides OSError.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error, zlib.error)


def decode_image(data: bytes, limits: MediaLimits = MediaLimits(), item: str | None = None) -> Image.Image:
    """Decode ``data`` to an RGB image, EXIF-rotated, with the pixel cap checked before decoding.

    Raises BadMedia (empty, truncated, corrupt), UnsupportedMedia (not jpeg/png/webp/gif/bmp,
    video bytes, HTML), MediaTooLarge (over ``limits.max_bytes`` or ``limits.max_image_pixels``).
    """
    if len(data) > limits.max_bytes:
        raise MediaTooLarge(f"image is {len(data)} bytes, over the {limits.max_bytes}-byte limit", item)
    try:
        kind = sniff(data)
    except (BadMedia, UnsupportedMedia) as exc:
        raise type(exc)(exc.message, item) from exc
    if kind.modality != "image":
        raise UnsupportedMedia(f"expected an image, got {kind.format} video", item)
    fmt = kind.format

    img = _open_header(data, fmt, limits, item)
    try:
        img.load()  # the full decode (first frame of an animation)
        return to_rgb(_upright(img))
    except Image.DecompressionBombError as exc:
        raise MediaTooLarge(f"{fmt} image refused by the decompression-bomb check: {exc}", item) from exc
    except _DECODE_ERRORS as exc:
        raise BadMedia(f"corrupt or truncated {fmt} image: {_reason(exc)}", item) from exc


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
    """Apply the EXIF orientation. Corrupt EXIF only loses the rotation, not the image."""
    try:
        return ImageOps.exif_transpose(img)
    except _DECODE_ERRORS:
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
