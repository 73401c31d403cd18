"""How many patches an item will cost, known before it is decoded: the encoder's unit of admission.

An image's header gives its size without decoding (Pillow reads a few hundred bytes), and
``smart_resize`` turns that into the grid the preprocessing will produce, so a 4K photo counts as
~20x a thumbnail at admission instead of as one item like it. A video's patch count depends on
its duration and frame rate, which only a demux reveals; its estimate is the mean of the videos
seen so far (``PatchEstimator``), corrected to the real count once the frames are sampled.
"""

from __future__ import annotations

import io
from collections import deque

from PIL import Image

from media_io.config import PreprocessConfig
from media_io.preprocess.resize import smart_resize

# A video's patch count before any video was seen: 8 frames' worth at the smallest video frame
# size (8 x video_min_pixels / patch^2 = 8 x 512 under Qwen2-VL's defaults). A guess that only
# the first videos' admission uses.
DEFAULT_VIDEO_FRAMES = 8


def image_patches(data: bytes, cfg: PreprocessConfig) -> int | None:
    """The patch count of an image from its header (None: the header does not say; the decode
    will fail or tell)."""
    try:
        # (a decompression-bomb warning may print; the decode refuses such an image itself)
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
        h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    except Exception:  # an estimate: whatever the header parser chokes on, the decode reports
        return None
    return (h // cfg.patch_size) * (w // cfg.patch_size)


class PatchEstimator:
    """Patch estimates for admission: images from their headers, videos from the recent mean."""

    def __init__(self, cfg: PreprocessConfig, window: int = 32) -> None:
        self.cfg = cfg
        per_frame = max(cfg.video_min_pixels // (cfg.patch_size * cfg.patch_size), 1)
        self._video_seed = float(per_frame * DEFAULT_VIDEO_FRAMES)
        self._videos: deque[int] = deque(maxlen=window)
        self._images: deque[int] = deque(maxlen=window)  # for images whose header says nothing

    def estimate(self, data: bytes, modality: str) -> float:
        if modality == "image":
            n = image_patches(data, self.cfg)
            if n is not None:
                return float(n)
            return (
                sum(self._images) / len(self._images)
                if self._images
                else self.cfg.min_pixels / (self.cfg.patch_size**2)
            )
        return sum(self._videos) / len(self._videos) if self._videos else self._video_seed

    def observe(self, modality: str, patches: int) -> None:
        """The real count of an item once preprocessed (what later estimates learn from)."""
        (self._videos if modality == "video" else self._images).append(patches)
