"""What the Python wrappers of llm_core's optional C kernels (``cpu_attention``, ``cpu_moe``) share:
loading the extension, its SIMD level, and handing it tensor memory.

The extensions are built by ``pip install`` (setup.py) and are optional: without a C compiler they
are missing, ``load`` returns None and the wrappers report themselves unavailable.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from epd_common import native
from epd_common.mkl_dispatch import mkl_runs_avx512, mkl_runs_bf16_dot


def load(name: str) -> ModuleType | None:
    """The extension module ``name`` (e.g. "llm_core.kernels._moe"), or None when it was not built or is
    stale (built from other sources than this tree's; ``epd_common.native``)."""
    return native.load(name)


def raw(t: Tensor) -> np.ndarray:
    """A contiguous CPU tensor's own memory as a kernel buffer, no copy; bf16 as its 16-bit
    patterns (numpy has no bfloat16). The kernel is told the dtype separately."""
    return (t.view(torch.int16) if t.dtype is torch.bfloat16 else t).numpy()


def buffer(t: Tensor) -> np.ndarray:
    """A CPU tensor's memory as a C-contiguous buffer for a kernel (no copy when already contiguous;
    bf16 as in ``raw``)."""
    return raw(t.detach().contiguous())


def simd(kernel: ModuleType | None) -> str | None:
    """'avx512', 'avx2' or 'scalar' (the primitives ``kernel`` uses), None when it is not built."""
    return None if kernel is None else str(kernel.simd())


def set_simd(kernel: ModuleType | None, name: str) -> None:
    """Make ``kernel`` use its 'avx512' (the MoE products), 'avx2' or 'scalar' primitives from now on (ValueError where the CPU
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


@functools.cache  # the CPU and MKL's code path do not change once torch is loaded
def expert_blas_min_rows() -> int:
    """Rows from which a routed expert multiplies through BLAS (single-threaded MKL on one of the
    layer pool's threads, ``_moe.h``) rather than the small-M product, chosen for this process at
    import: every expert (1) where MKL runs its AVX-512 code (an Intel CPU with it, or an AMD one
    where ``epd_common.mkl_dispatch`` let it), which ran 1.6-2.3x our AVX2 small-M product for an
    expert of 1-4 rows and 3x at 256 (Intel, served medium model, c = 8: 171 vs 103 tokens/s), and
    on a Zen 5 AMD cut a decode step's routed experts at c = 32 from 33.3 to 24.9 ms against our
    AVX-512 product (docs/performance.md); experts of 16 rows or more (a prefill chunk's) where
    MKL runs its AVX2 code, where the small-M product was the faster one for decode."""
    return 1 if mkl_runs_avx512() else 16


@functools.cache  # as expert_blas_min_rows: fixed once torch is loaded
def bf16_products_default() -> bool:
    """Whether the decoder-layer kernel runs bf16 weights as bf16 products by default (``_blas.h``:
    every product's input rounded to bf16, many rows in MKL's bf16 x bf16 -> float32 product):
    where that product has bf16 dot products under it (``mkl_runs_bf16_dot``), about twice
    sgemm's FLOPs; elsewhere the inputs stay float32 (as fast there, and a rounding less)."""
    return mkl_runs_bf16_dot()


# A bf16 expert goes through BLAS from this many rows at the least: its weight is first widened
# to float32 (a pass over it at write bandwidth), which pays only when many rows share it; fewer
# rows stream the bf16 weight through the small-M product.
BF16_EXPERT_BLAS_FLOOR = 16


def blas_thresholds(n: int, bf16: int | None = None) -> tuple[int, int]:
    """The kernels' (float32, bf16) expert BLAS thresholds for float32 threshold n; the bf16 one by
    default max(n, ``BF16_EXPERT_BLAS_FLOOR``)."""
    return n, max(n, BF16_EXPERT_BLAS_FLOOR) if bf16 is None else bf16


def bind_blas(kernel: ModuleType | None) -> bool:
    """``bind_sgemm``, then the routed experts' BLAS thresholds (``expert_blas_min_rows``) and
    whether bf16 products of many rows run in MKL's bf16 product (``bf16_products_default``)."""
    if not bind_sgemm(kernel):
        return False
    assert kernel is not None
    kernel.set_blas_min_rows(*blas_thresholds(expert_blas_min_rows()))
    kernel.set_bf16_gemm(bf16_products_default())
    return True
