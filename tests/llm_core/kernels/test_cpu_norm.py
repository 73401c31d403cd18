"""The C RMSNorm kernel (cpu_norm) against torch's, alone and fused with the residual add."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llm_core.backends.norm import CpuNorm, TorchNorm
from llm_core.kernels import cpu_norm
from llm_core.models.decoder import RMSNorm

pytestmark = pytest.mark.skipif(not cpu_norm.AVAILABLE, reason="llm_core.kernels._rms_norm is not built")


@pytest.mark.parametrize("shape", [(1, 8), (5, 37), (3, 4, 64), (0, 16), (2048, 256)])
def test_matches_torch(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(shape, generator=g) * 3, torch.randn(shape, generator=g)
    w = torch.randn(shape[-1], generator=g)
    x0, r0 = x.clone(), r.clone()
    out, total = cpu_norm.rms_norm_cpu(x, w, 1e-6)
    assert total is None
    torch.testing.assert_close(out, F.rms_norm(x, (shape[-1],), w, 1e-6), rtol=1e-6, atol=1e-6)
    out, total = cpu_norm.rms_norm_cpu(x, w, 1e-6, r)
    assert total is not None
    assert torch.equal(total, r + x)  # one float add per element: exact
    torch.testing.assert_close(out, F.rms_norm(r + x, (shape[-1],), w, 1e-6), rtol=1e-6, atol=1e-6)
    assert torch.equal(x, x0) and torch.equal(r, r0)  # inputs untouched


def test_module_uses_the_kernel_and_agrees_with_torch() -> None:
    norm = RMSNorm(48, 1e-5)
    norm.backend = CpuNorm()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=torch.Generator().manual_seed(1)))
    x, r = torch.randn(7, 48), torch.randn(7, 48)
    fast, fast_add = norm(x), norm.add_forward(x, r)
    norm.backend = TorchNorm()
    torch.testing.assert_close(fast, norm(x), rtol=1e-6, atol=1e-6)
    for a, b in zip(fast_add, norm.add_forward(x, r), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_mismatched_sizes_are_errors() -> None:
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="weight"):
        cpu_norm.rms_norm_cpu(x, torch.ones(15), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        cpu_norm.rms_norm_cpu(x, torch.ones(16), 1e-6, torch.randn(3, 16))
