"""Qwen2-VL-style preprocessing: ``smart_resize`` -> bicubic resize -> mean/std normalize -> patchify.

Two backends produce the same ``Patches`` layout (``pixel_values [N, cfg.row_size]`` float32:
1176 for Qwen2-VL's patch 14, 1536 for MiMo-V2.5's patch 16; ``grid_thw`` in patches, rows in
merge groups): ``cpu`` (Pillow-SIMD + numpy) and ``dali`` (NVIDIA DALI, GPU when CUDA is
present). Patch, merge and temporal size, pixel bounds and mean/std all come from the
``PreprocessConfig``. Pick one with ``get_backend(name, cfg)``.

This package knows nothing of fetching, models or serving.

May import: epd_common, media_io; never: media_io.fetch, media_io.ssrf.
"""

from media_io.preprocess.backend import BackendName, PreprocessBackend, get_backend
from media_io.preprocess.patchify import Patches, patchify_uint8
from media_io.preprocess.resize import smart_resize

__all__ = ["BackendName", "Patches", "PreprocessBackend", "get_backend", "patchify_uint8", "smart_resize"]
