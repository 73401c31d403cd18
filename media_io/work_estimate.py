"""How many patches an item will cost, known before it is decoded: the encoder's unit of admission.

An image's header gives its size without decoding (Pillow reads a few hundred bytes), and
``smart_resize`` turns that into the grid the preprocessing will produce, so a 4K photo counts as
~20x a thumbnail at admission instead of as one item like it. A video's patch count depends on
its duration and frame rate, which only a demux reveals; its estimate is the mean of the videos
seen so far (``PatchEstimator``), corrected to the real count once the frames are sampled. An
audio clip counts its mel frames (100 a second at MiMo-V2.5's rate) from the duration its header
declares (a header that says none: the recent mean), then the real count once decoded. Frames and patches share one measured rate; a coarse mix, but
a mel frame costs the audio encoder about what a patch costs the vision tower at real widths.
"""

from __future__ import annotations

import io
from collections import deque

from PIL import Image

from media_io.audio import probe_audio
from media_io.config import PreprocessConfig
from media_io.errors import MediaError
from media_io.preprocess.resize import smart_resize

# A video's patch count before any video was seen: 8 frames' worth at the smallest video frame
# size (8 x video_min_pixels / patch^2 = 8 x 512 under Qwen2-VL's defaults). A guess that only
# the first videos' admission uses.
DEFAULT_VIDEO_FRAMES = 8
# An audio clip's mel frames before any clip was seen: 10 s.
AUDIO_SEED_FRAMES = 1000
AUDIO_FRAMES_PER_S = 100  # MiMo-V2.5's mel hop at its rate


def audio_seconds(data: bytes) -> float:
    """A clip's length as its header declares it (0.0: it does not say, or the bytes are no
    audio PyAV reads; the decode reports those). A header is a few hundred bytes to read, so an
    hour counts as an hour at admission, before any work is done."""
    try:
        return probe_audio(data).declared_s
    except MediaError:
        return 0.0


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
        self._audio: deque[int] = deque(maxlen=window)  # audio clips' mel frames

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
        if modality == "audio":  # mel frames (100 a second): from the header, else the recent mean
            declared = audio_seconds(data)
            if declared:
                return declared * AUDIO_FRAMES_PER_S
            return sum(self._audio) / len(self._audio) if self._audio else float(AUDIO_SEED_FRAMES)
        return sum(self._videos) / len(self._videos) if self._videos else self._video_seed

    def observe(self, modality: str, patches: int) -> None:
        """The real count of an item once preprocessed (what later estimates learn from)."""
        by = {"video": self._videos, "audio": self._audio}
        by.get(modality, self._images).append(patches)
