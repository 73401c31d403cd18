"""JPEG decode through libjpeg into a buffer the calling thread reuses: the cpu backend's fast path.

Pillow's JPEG decode allocates a new image for every call (8 MB at 1920x1080, 48 MB at 4032x3024)
and frees it right after the resize. Under concurrency those large short-lived allocations are
page-faulted in and unmapped again on every image, in every thread, and that memory-map churn is
what kept two preprocessing threads from running twice as fast as one. Here ``media_io._jpeg``
decodes the whole file in one libjpeg call, with the GIL released, into a buffer that belongs to
the calling thread and is reused by its next decode; Pillow maps that buffer as an RGBX image
without a copy (4 bytes per pixel is Pillow's own layout for RGB), so the resize reads it in place.

    bytes --open_header (sniff, byte and pixel caps, EXIF)--> eligible?
          --libjpeg at s/8, s in 8, 4, 2, 1 (accurate IDCT, fancy upsampling)--> thread buffer
          --Image.frombuffer("RGBX") (a view)--> caller

Reduced-scale decode: ``min_size`` gives the size the image must keep (a ``smart_resize``
target); libjpeg's IDCT then decodes at the smallest of 1/2, 1/4, 1/8 that still covers it, as
``media_io.image`` does with Pillow's ``draft``. Only those scales: libjpeg-turbo has SIMD IDCTs
for them, while 3/8 .. 7/8 run in plain C and decode slower than full size.

Scope: JPEGs that libjpeg converts to RGB by itself (YCbCr, RGB, greyscale) and that need no EXIF
rotation. Anything else, and any libjpeg error or warning (truncated or corrupt data), returns
``None``: the caller then decodes with ``media_io.image``, which owns the typed errors for bad
input. What the header alone can refuse (wrong format, byte and pixel caps) raises here already.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import NamedTuple

import numpy as np
from PIL import Image

from epd_common import native
from media_io.config import MediaLimits
from media_io.image import SizeHint, image_format, open_header, orientation

# Built by `pip install` when libjpeg's headers are present; None when missing or stale.
_kernel: ModuleType | None = native.load("media_io._jpeg")

JPEG_KERNEL_AVAILABLE = _kernel is not None

# A thread keeps its buffer between images up to this size (a 16-Mpixel photo at full scale); a
# larger image gets a one-off buffer rather than pinning that much memory in the thread for good.
_MAX_KEPT_BYTES = 64 << 20

_local = threading.local()


class ThreadDecodedJpeg(NamedTuple):
    """A decoded JPEG in the calling thread's buffer."""

    image: Image.Image  # RGBX view of the thread's buffer: valid until this thread decodes again
    full_size: tuple[int, int]  # (height, width) at full resolution


def decode_jpeg_reusing(
    data: bytes, limits: MediaLimits = MediaLimits(), item: str | None = None, *, min_size: SizeHint
) -> ThreadDecodedJpeg | None:
    """Decode ``data`` into this thread's buffer, or ``None`` when the fast path does not apply.

    ``min_size(height, width) -> (min_height, min_width)`` allows a 1/2, 1/4 or 1/8 decode (see
    the module docstring). The returned image is overwritten by this thread's next call: use it
    (resize it, copy it) before decoding again.

    Raises what ``media_io.image.open_header`` raises (not an image, over the byte or pixel cap,
    corrupt JPEG header) and whatever ``min_size`` raises.
    """
    if _kernel is None or image_format(data, limits, item) != "jpeg":
        return None  # other formats: the caller's Pillow path parses their header (once)
    img, _ = open_header(data, limits, item)
    if img.mode not in ("RGB", "L") or orientation(img) != 1:
        return None  # CMYK/YCCK, or a rotation to apply: Pillow's path handles those
    width, height = img.size
    scale = _scale_num(height, width, min_size(height, width))
    out_h, out_w = -(-height * scale // 8), -(-width * scale // 8)  # libjpeg rounds up
    buffer = _thread_buffer(out_h * out_w * 4)
    try:
        decoded = _kernel.decode(data, scale, buffer)
    except ValueError:
        return None  # libjpeg error or warning: let Pillow's path decide and name the error
    if decoded != (out_h, out_w):  # pragma: no cover - libjpeg's scaling rule is fixed
        return None
    view = Image.frombuffer("RGBX", (out_w, out_h), buffer[: out_h * out_w * 4], "raw", "RGBX", 0, 1)
    return ThreadDecodedJpeg(view, (height, width))


def _scale_num(height: int, width: int, target: tuple[int, int]) -> int:
    """The smallest of 8, 4, 2, 1 (eighths) whose decoded size still covers ``target`` on both sides."""
    target_h, target_w = target
    scale = 8
    while scale > 1:
        half = scale // 2
        if -(-height * half // 8) < target_h or -(-width * half // 8) < target_w:
            break
        scale = half
    return scale


def _thread_buffer(nbytes: int) -> np.ndarray:
    """At least ``nbytes`` of uint8 owned by the calling thread (grown, never shrunk, up to the cap)."""
    if nbytes > _MAX_KEPT_BYTES:
        return np.empty(nbytes, dtype=np.uint8)
    buffer: np.ndarray | None = getattr(_local, "buffer", None)
    if buffer is None or buffer.size < nbytes:
        buffer = np.empty(nbytes, dtype=np.uint8)
        _local.buffer = buffer
    return buffer
