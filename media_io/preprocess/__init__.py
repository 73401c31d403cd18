"""Qwen2-VL preprocessing: ``smart_resize`` -> bicubic resize -> CLIP normalize -> patchify.

Two backends produce the same ``Patches`` layout (``pixel_values [N, 1176]`` float32, ``grid_thw``
in patches, rows in 2x2 merge groups): ``cpu`` (Pillow-SIMD + numpy) and ``dali`` (NVIDIA DALI,
GPU when CUDA is present). Pick one with ``get_backend(name, cfg)``.

This package knows nothing of fetching, models or serving.
"""

from media_io.preprocess.backend import BackendName, PreprocessBackend, get_backend
from media_io.preprocess.patchify import Patches, patchify_uint8
from media_io.preprocess.resize import smart_resize

__all__ = ["BackendName", "Patches", "PreprocessBackend", "get_backend", "patchify_uint8", "smart_resize"]
