"""What this process decodes and preprocesses media with: the fast paths, or their stand-ins.

Every stand-in gives the same results (within the preprocessing tolerance), only slower, so a
missing or stale C kernel or a plain Pillow build shows nowhere else. ``epd encoder`` puts this in
its /health; ``epd serve`` prints it at start.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import PIL

from epd_common import native
from epd_common.active_paths import ActivePath


def media_paths(backend: str) -> list[ActivePath]:
    """The steps of the ``backend`` ("cpu" or "dali") preprocessing path and what runs each."""
    from media_io.jpeg import JPEG_KERNEL_AVAILABLE
    from media_io.preprocess.patchify import C_KERNEL_AVAILABLE

    jpeg_why = None if JPEG_KERNEL_AVAILABLE else native.unavailable_reason("media_io._jpeg")
    patchify_why = None if C_KERNEL_AVAILABLE else native.unavailable_reason("media_io.preprocess._patchify")
    paths = [
        ActivePath("preprocess_backend", backend),
        ActivePath(
            "jpeg_decode",
            "Pillow" if jpeg_why else "libjpeg into reused buffers, DCT-scaled (media_io._jpeg)",
            jpeg_why,
        ),
        ActivePath(
            "patchify", "numpy" if patchify_why else "C kernel (media_io.preprocess._patchify)", patchify_why
        ),
        _resize_path(),
        _dali_path(required=backend == "dali"),
    ]
    return paths


def _resize_path() -> ActivePath:
    try:
        importlib.metadata.version("pillow-simd")
    except importlib.metadata.PackageNotFoundError:
        return ActivePath(
            "resize",
            f"Pillow {PIL.__version__}",
            "pillow-simd is not installed: its resize is several times faster",
        )
    return ActivePath("resize", f"Pillow-SIMD {PIL.__version__}")


def _dali_path(required: bool) -> ActivePath:
    if importlib.util.find_spec("nvidia.dali") is None:
        return ActivePath("dali", "not installed", "the dali backend needs nvidia-dali" if required else None)
    import torch

    device = "GPU" if torch.cuda.is_available() else "CPU operators (no CUDA device)"
    return ActivePath("dali", f"nvidia-dali {_dali_version()} on {device}")


def _dali_version() -> str:
    """The installed DALI wheel's version (its distribution is named after the CUDA it targets)."""
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"] or ""
        if name.lower().startswith("nvidia-dali"):
            return str(dist.version)
    return "(version unknown)"
