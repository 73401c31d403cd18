"""RMSNorm backends, alone and fused with the residual add before a pre-norm:

    norm(x, weight, eps)                 -> weight * (x * rsqrt(mean(x^2) + eps))
    add_norm(x, residual, weight, eps)   -> (norm(residual + x), residual + x)

Both return fresh tensors and leave their inputs unchanged. "torch" is the reference (any dtype:
computed in fp32, cast back before the weight); "cpu" is the C kernel of ``kernels.cpu_norm``
(fp32 CPU, each add and norm in one pass), equal to torch's to float32 rounding.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from llm_core.kernels import cpu_norm


class NormBackend(ABC):
    name: ClassVar[str]

    def describe(self) -> str:
        """What runs the RMSNorms, for /health's ``paths``."""
        return self.name

    @abstractmethod
    def norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """x [..., dim], weight [dim] -> [..., dim]."""

    @abstractmethod
    def add_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """(norm(residual + x), residual + x)."""


class TorchNorm(NormBackend):
    name = "torch"

    def norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            # one op instead of six; bit-identical to the expression below for fp32 (tested)
            return F.rms_norm(x, weight.shape, weight, eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        total = residual + x
        return self.norm(total, weight, eps), total


class CpuNorm(NormBackend):
    name = "cpu"

    def describe(self) -> str:
        return "C RMSNorm fused with the residual add"

    def norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return cpu_norm.rms_norm_cpu(x, weight, eps)[0]

    def add_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        normed, total = cpu_norm.rms_norm_cpu(x, weight, eps, residual)
        assert total is not None
        return normed, total
