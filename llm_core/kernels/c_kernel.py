"""What the Python wrappers of llm_core's optional C kernels (``cpu_attention``, ``cpu_moe``) share:
loading the extension, its SIMD level, and handing it tensor memory.

The extensions are built by ``pip install`` (setup.py) and are optional: without a C compiler they
are missing, ``load`` returns None and the wrappers report themselves unavailable.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from epd_common import native


def load(name: str) -> ModuleType | None:
    """The extension module ``name`` (e.g. "llm_core.kernels._moe"), or None when it was not built or is
    stale (built from other sources than this tree's; ``epd_common.native``)."""
    return native.load(name)


def buffer(t: Tensor) -> np.ndarray:
    """A CPU tensor's memory as a C-contiguous buffer for a kernel (no copy when already contiguous)."""
    return t.detach().contiguous().numpy()


def simd(kernel: ModuleType | None) -> str | None:
    """'avx2' or 'scalar' (the primitives ``kernel`` uses), None when it is not built."""
    return None if kernel is None else str(kernel.simd())


def set_simd(kernel: ModuleType | None, name: str) -> None:
    """Make ``kernel`` use its 'avx2' or 'scalar' primitives from now on (ValueError where the CPU
    lacks them); each kernel picks the best at import, so this exists for tests of both paths."""
    if kernel is None:
        raise RuntimeError("this C kernel is not built")
    kernel.set_simd(name)


def bind_sgemm(kernel: ModuleType | None) -> bool:
    """Give ``kernel`` torch's own sgemm (``_blas.h``: libtorch_cpu exports it) for its products of
    many rows; False when the kernel is not built or this torch build has no such symbol."""
    if kernel is None:
        return False
    try:
        kernel.bind_sgemm(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    except OSError:  # pragma: no cover - a torch build without BLAS symbols
        return False
    return True


# Rows from which a routed expert multiplies through BLAS rather than the small-M product (_moe.h).
# A prefill chunk's experts (hundreds of rows) run ~3x faster through MKL's sgemm. Below 16 rows the
# small-M product stays: on the Intel Xeon of session 21 MKL ran a lone expert of 1-4 rows 1.6-2.3x
# faster in a single-threaded loop and in bench.step_profile, yet with every expert through it the
# served engine collapsed (ITL P50 445 ms against 55 at c = 8): MKL's OpenMP team and the layer's
# thread pool then alternate 176 times a step and contend for the 2 cores (docs/performance.md).
EXPERT_BLAS_MIN_ROWS = 16


def bind_blas(kernel: ModuleType | None) -> bool:
    """``bind_sgemm``, then the routed experts' BLAS threshold (``EXPERT_BLAS_MIN_ROWS``)."""
    if not bind_sgemm(kernel):
        return False
    assert kernel is not None
    kernel.set_blas_min_rows(EXPERT_BLAS_MIN_ROWS)
    return True
