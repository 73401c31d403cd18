"""What this engine process runs its layers with: the fast paths, or their stand-ins.

On CPU in fp32 a decoder layer is one C call (``cpu_layer``) built from the per-op kernels; without
the extensions (not built, or stale) or without torch's sgemm bound, the model runs its torch
modules, which give the same results slower. On CUDA, attention is the Triton kernels and the C
kernels do not apply. ``epd llm`` puts this in its /health; ``epd serve`` prints it at start.
"""

from __future__ import annotations

import torch

from epd_common import native
from epd_common.active_paths import ActivePath
from llm_core.kernels import cpu_attention, cpu_layer, cpu_moe, cpu_norm


def llm_paths(device: torch.device, dtype: torch.dtype) -> list[ActivePath]:
    """The engine's hot steps on ``device`` with weights in ``dtype``, and what runs each."""
    if device.type == "cuda":
        return [
            ActivePath("attention", "Triton paged prefill/decode kernels"),
            ActivePath("layers", "torch modules"),
        ]
    if dtype != torch.float32:
        why = f"the C kernels are fp32 only and the weights are {str(dtype).removeprefix('torch.')}"
        return [ActivePath("layers", "torch modules", why)]
    threads = torch.get_num_threads()
    return [
        _kernel_path(
            "decoder_layer",
            cpu_layer.AVAILABLE,
            "llm_core.kernels._decoder_layer",
            f"one C call per layer ({cpu_attention.simd()}, torch's sgemm, {threads} threads)",
            "the model's torch modules",
            unbound="torch's sgemm_ could not be bound from libtorch_cpu",
        ),
        _kernel_path(
            "attention",
            cpu_attention.AVAILABLE,
            "llm_core.kernels._paged_attention",
            f"C paged attention ({cpu_attention.simd()})",
            "torch",
        ),
        _kernel_path(
            "moe",
            cpu_moe.AVAILABLE,
            "llm_core.kernels._moe",
            f"C experts and router ({cpu_moe.simd()})",
            "torch",
        ),
        _kernel_path(
            "rms_norm",
            cpu_norm.AVAILABLE,
            "llm_core.kernels._rms_norm",
            "C RMSNorm fused with the residual add",
            "torch",
        ),
    ]


def _kernel_path(
    step: str, available: bool, extension: str, fast: str, slow: str, unbound: str | None = None
) -> ActivePath:
    """``fast`` when the wrapper has its kernel, else ``slow`` with the load's reason (or
    ``unbound`` when the extension loaded but the wrapper could not use it)."""
    if available:
        return ActivePath(step, fast)
    why = native.fallback_reason(extension) or unbound or native.unavailable_reason(extension)
    return ActivePath(step, slow, why)
