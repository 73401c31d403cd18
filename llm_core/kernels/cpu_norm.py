"""CPU RMSNorm through the C kernel (``_rms_norm.c``), optionally fused with the residual add before it.

    rms_norm_cpu(x, weight, eps)              -> weight * (x * rsqrt(mean(x^2) + eps))
    rms_norm_cpu(x, weight, eps, residual)    -> (rms_norm(x + residual), x + residual)

Why: torch runs an RMSNorm on CPU as several element-wise and reduction ops (~50 us for a decode
batch of 32 rows of 256), and a pre-norm decoder layer has two norms and two residual adds; the
kernel does each pair in one pass. Results agree with ``F.rms_norm`` to float32 rounding. fp32 only;
``AVAILABLE`` is False when the extension was not built, and ``backends.selector`` chooses torch's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llm_core.kernels import c_kernel
from llm_core.kernels.c_kernel import buffer as _buf

_kernel = c_kernel.load("llm_core.kernels._rms_norm")

AVAILABLE = _kernel is not None


def supports(x: Tensor, weight: Tensor) -> bool:
    """True when the kernel can run these tensors (built, CPU, fp32)."""
    return (
        _kernel is not None
        and x.device.type == weight.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
    )


def rms_norm_cpu(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """x [..., dim] -> (normed [..., dim], x + residual or None). Fresh tensors; inputs are not changed."""
    if _kernel is None or not supports(x, weight):
        raise RuntimeError("rms_norm_cpu needs the built kernel and fp32 CPU tensors")
    dim = x.shape[-1]
    rows = x.numel() // dim
    out = torch.empty(x.shape, dtype=torch.float32)
    total = None if residual is None else torch.empty(x.shape, dtype=torch.float32)
    _kernel.rms_norm(
        _buf(x),
        _buf(weight),
        b"" if residual is None else _buf(residual),
        out.numpy(),
        bytearray() if total is None else total.numpy(),
        rows,
        dim,
        float(eps),
    )
    return out, total
