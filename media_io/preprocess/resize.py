"""Qwen2-VL's ``smart_resize``: the target size every backend resizes to.

The rule (identical to transformers' ``Qwen2VLImageProcessor``):

1. reject aspect ratios above 200:1 (the ViT cannot tile them sensibly);
2. round each side to the nearest multiple of ``factor`` = patch x merge (Qwen2-VL 14 x 2 = 28,
   MiMo-V2.5 16 x 2 = 32);
3. if the area is above ``max_pixels``, scale both sides down by the same factor and floor to
   multiples of ``factor`` (never below ``factor``); if below ``min_pixels``, scale up and ceil.

Python's ``round`` (banker's rounding) is part of the rule: ``round(2.5) == 2``. Using it keeps
our grid identical to the reference for sides that are an odd multiple of ``factor / 2``.
Every bound is the caller's (its ``PreprocessConfig``): there are no defaults here.
"""

from __future__ import annotations

import math

from media_io.config import PreprocessConfig
from media_io.errors import BadMedia

MAX_ASPECT_RATIO = 200.0


def smart_resize(
    height: int,
    width: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    *,
    item: str | None = None,
) -> tuple[int, int]:
    """The ``(height, width)`` to resize an image of ``height x width`` to.

    Both results are multiples of ``factor``; their product lies in ``[min_pixels, max_pixels]``
    except where ``factor`` itself forces more (a ``factor``-pixel floor on each side).

    Raises:
        BadMedia: a side is not positive, or the aspect ratio is above 200:1 (``item`` names
            the media in the message).
    """
    if height <= 0 or width <= 0:
        raise BadMedia(f"image has an empty side: {width}x{height} (width x height)", item)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise BadMedia(
            f"aspect ratio {ratio:.1f}:1 of a {width}x{height} (width x height) image is above the "
            f"{MAX_ASPECT_RATIO:.0f}:1 limit",
            item,
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_frame_target(
    height: int, width: int, cfg: PreprocessConfig = PreprocessConfig(), item: str | None = None
) -> tuple[int, int]:
    """The size ``video()`` resizes sampled ``height x width`` frames to.

    Frames from ``media_io.video.decode_video`` are already at their target: sides multiples of
    ``cfg.factor`` and an area at most ``video_max_pixels`` (its per-frame cap shrinks with the
    frame count, so the area may even be below ``video_min_pixels``). Such frames are kept as
    they are: resizing them again to the uncapped target would blow up a long video's token
    count. Any other frames get ``smart_resize`` under the video pixel bounds.
    """
    f = cfg.factor
    if height % f == 0 and width % f == 0 and 0 < height * width <= cfg.video_max_pixels:
        return height, width
    return smart_resize(height, width, f, cfg.video_min_pixels, cfg.video_max_pixels, item=item)
