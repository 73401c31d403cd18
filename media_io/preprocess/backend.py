"""The preprocessing backend interface and the factory that picks one.

Every backend turns media into the same ``Patches`` layout (see ``patchify.py``): the ViT cannot
tell which backend ran, up to resampling differences bounded by the parity tests against
transformers' ``Qwen2VLImageProcessor`` (configured with the same ``PreprocessConfig`` values).
Backends differ only in where the work runs:

- ``cpu``: Pillow(-SIMD) decode and bicubic resize, numpy normalize + patchify.
- ``dali``: an NVIDIA DALI pipeline, nvJPEG decode and resize on the GPU when CUDA is present,
  DALI's CPU operators otherwise.

Backends are thread-compatible: one instance may be called from several executor threads.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np
from PIL import Image

from media_io.config import MediaLimits, PreprocessConfig
from media_io.preprocess.patchify import Patches

BackendName = Literal["cpu", "dali"]


class PreprocessBackend(Protocol):
    """Qwen2-VL-style preprocessing: resize to ``smart_resize``'s target, normalize, patchify.

    Invariants every implementation keeps:
    - ``pixel_values`` is ``[t * h * w, cfg.row_size]`` float32 (3 * tp * p * p values: 1176 for
      patch 14, 1536 for patch 16), contiguous; ``grid_thw == (t, h, w)`` in patches.
    - rows come in merge groups (``merge_size ** 2`` consecutive rows), each row (C, T, py, px)
      flattened.
    - images have ``t == 1`` (the frame repeated ``temporal_patch_size`` times).
    - errors about the input are ``MediaError`` subclasses (e.g. BadMedia for a 300:1 image).
    """

    name: str
    cfg: PreprocessConfig

    def image(self, img: Image.Image, item: str | None = None) -> Patches:
        """One decoded image (any PIL mode; converted to RGB as transformers does)."""
        ...

    def images(self, imgs: Sequence[Image.Image]) -> list[Patches]:
        """Several images, one ``Patches`` each, in order (backends may batch internally)."""
        ...

    def video(self, frames: np.ndarray, item: str | None = None) -> Patches:
        """Sampled frames ``[T, H, W, 3]`` uint8 RGB. Frames already at a target size (sides
        multiples of ``cfg.factor``, area within ``video_max_pixels``, as ``decode_video`` produces) are used
        as they are; others are resized (``resize.video_frame_target``). ``T`` is padded to a
        multiple of ``temporal_patch_size`` by repeating the last frame."""
        ...

    def image_bytes(
        self, data: bytes, limits: MediaLimits = MediaLimits(), item: str | None = None
    ) -> Patches:
        """Encoded image bytes, decode included (each backend uses its own decoder)."""
        ...


@functools.cache
def get_backend(name: BackendName, cfg: PreprocessConfig = PreprocessConfig()) -> PreprocessBackend:
    """The backend called ``name`` for ``cfg``; one shared instance per ``(name, cfg)``.

    Instances are cached because the DALI backend builds its pipelines once (seconds) and
    reuses them. Raises ``ValueError`` for an unknown name; ``dali`` raises ``ImportError`` when
    ``nvidia.dali`` is not installed.
    """
    if name == "cpu":
        from media_io.preprocess.cpu import CpuBackend

        return CpuBackend(cfg)
    if name == "dali":
        from media_io.preprocess.dali import DaliBackend

        return DaliBackend(cfg)
    raise ValueError(f"unknown preprocessing backend {name!r}; expected 'cpu' or 'dali'")
