"""What the Python wrappers of llm_core's optional C kernels (``cpu_attention``, ``cpu_moe``) share:
loading the extension, its SIMD level, and handing it tensor memory.

The extensions are built by ``pip install`` (setup.py) and are optional: without a C compiler they
are missing, ``load`` returns None and the wrappers report themselves unavailable.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
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
