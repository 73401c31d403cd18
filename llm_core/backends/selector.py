"""The backends of one engine: chosen once from the device, the weights' dtype and which kernels
are built, with a per-kind override (tests, benchmarks), and named for /health.

    device   dtype     attention   moe     norm    layer
    cuda     any       triton      torch   torch   none
    cpu      float32   cpu         cpu     cpu     cpu      (each where its extension is built;
                                                             the layer kernel only under "cpu"
                                                             attention: it is the same kernels)
    cpu      bfloat16  torch       torch   torch   cpu      (the layer kernel stores weights and KV
                                                             in bf16 and computes in float32; the
                                                             per-op kernels are float32 only)
    other    any       torch       torch   torch   none
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from epd_common import native
from epd_common.active_paths import ActivePath
from llm_core.backends.attention import AttentionBackend, CpuAttention, TorchAttention, TritonAttention
from llm_core.backends.layer import CpuLayer, LayerBackend, NoLayer
from llm_core.backends.moe import CpuMoE, MoEBackend
from llm_core.backends.moe_torch import TorchMoE
from llm_core.backends.norm import CpuNorm, NormBackend, TorchNorm
from llm_core.kernels import cpu_attention, cpu_layer, cpu_moe, cpu_norm

ATTENTION: dict[str, type[AttentionBackend]] = {
    "torch": TorchAttention,
    "cpu": CpuAttention,
    "triton": TritonAttention,
}
MOE: dict[str, type[MoEBackend]] = {"torch": TorchMoE, "cpu": CpuMoE}
NORM: dict[str, type[NormBackend]] = {"torch": TorchNorm, "cpu": CpuNorm}
LAYER: dict[str, type[LayerBackend]] = {"none": NoLayer, "cpu": CpuLayer}


class BackendUnavailable(ValueError):
    """An override named a backend that does not exist or whose kernel is not built."""


@dataclass(frozen=True)
class Backends:
    """One backend of each kind (``llm_core.backends``)."""

    attention: AttentionBackend
    moe: MoEBackend
    norm: NormBackend
    layer: LayerBackend
    # kind -> why its fast backend was not chosen (the dtype, a kernel not built), for /health
    reasons: dict[str, str] = field(default_factory=dict, compare=False)

    def names(self) -> dict[str, str]:
        """{kind: backend name}, e.g. for /health."""
        return {
            "attention": self.attention.name,
            "moe": self.moe.name,
            "norm": self.norm.name,
            "layer": self.layer.name,
        }

    def paths(self) -> list[ActivePath]:
        """What runs each kind (``describe``), with the reason where a stand-in runs: /health's
        ``paths`` and the start banner, derived from the chosen backends themselves."""
        chosen = (
            ("layer", self.layer),
            ("attention", self.attention),
            ("moe", self.moe),
            ("norm", self.norm),
        )
        return [ActivePath(kind, b.describe(), self.reasons.get(kind)) for kind, b in chosen]


def reference_backends() -> Backends:
    """The torch reference for every kind: what a model runs until ``after_load`` chooses."""
    return Backends(TorchAttention(), TorchMoE(), TorchNorm(), NoLayer())


# kind -> the extension its "cpu" backend runs (for a stand-in's reason)
_EXTENSIONS = {
    "attention": "llm_core.kernels._paged_attention",
    "moe": "llm_core.kernels._moe",
    "norm": "llm_core.kernels._rms_norm",
    "layer": "llm_core.kernels._decoder_layer",
}


def _not_built_reason(kind: str) -> str:
    ext = _EXTENSIONS[kind]
    if kind == "layer" and native.fallback_reason(ext) is None and cpu_layer.BUILT:
        return "torch's sgemm_ could not be bound from libtorch_cpu"
    return native.fallback_reason(ext) or native.unavailable_reason(ext)


def _built(kind: str, name: str) -> bool:
    """Whether ``name``'s kernel is there (torch, Triton and "none" always are)."""
    available = {
        ("attention", "cpu"): cpu_attention.AVAILABLE,
        ("moe", "cpu"): cpu_moe.AVAILABLE,
        ("norm", "cpu"): cpu_norm.AVAILABLE,
        ("layer", "cpu"): cpu_layer.AVAILABLE,
    }
    return available.get((kind, name), True)


def select_backends(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    attention: str | None = None,
    moe: str | None = None,
    norm: str | None = None,
    layer: str | None = None,
) -> Backends:
    """The backends for weights of ``dtype`` on ``device`` (module doc); a kind given by name
    overrides the choice (``BackendUnavailable`` when it is unknown or not built)."""
    kind = torch.device(device).type
    fast = kind == "cpu" and dtype == torch.float32
    bf16_layer = kind == "cpu" and dtype == torch.bfloat16 and _built("layer", "cpu")
    default_attention = "triton" if kind == "cuda" else "cpu" if fast else "torch"
    chosen = {
        "attention": attention or default_attention,
        "moe": moe or ("cpu" if fast else "torch"),
        "norm": norm or ("cpu" if fast else "torch"),
    }
    # Only the fast path's defaults fall back when a kernel is missing; an override must exist.
    for k, default in list(chosen.items()):
        if not _built(k, default) and {"attention": attention, "moe": moe, "norm": norm}[k] is None:
            chosen[k] = "torch"
    chosen["layer"] = layer or (
        "cpu" if (fast and chosen["attention"] == "cpu" and _built("layer", "cpu")) or bf16_layer else "none"
    )
    tables: dict[str, dict[str, type]] = {"attention": ATTENTION, "moe": MOE, "norm": NORM, "layer": LAYER}
    reasons: dict[str, str] = {}
    if kind == "cpu" and not fast:
        name = str(dtype).removeprefix("torch.")
        why = f"the per-op C kernels are float32 only and the weights are {name}"
        reasons = {k: why for k, n in chosen.items() if n != "cpu"}
        if chosen["layer"] != "cpu" and not bf16_layer:
            reasons["layer"] = (
                f"the layer kernel stores float32 or bfloat16 only and the weights are {name}"
                if _built("layer", "cpu")
                else _not_built_reason("layer")
            )
    elif fast:
        requested = {"attention": attention, "moe": moe, "norm": norm, "layer": layer}
        for k, name in chosen.items():
            if name != "cpu" and requested[k] is None:  # a stand-in for a kernel that is missing
                reasons[k] = (
                    _not_built_reason(k) if not _built(k, "cpu") else "the attention kernel is missing"
                )
    for k, name in chosen.items():
        if name not in tables[k]:
            raise BackendUnavailable(f"unknown {k} backend {name!r}; known: {', '.join(sorted(tables[k]))}")
        if not _built(k, name):
            raise BackendUnavailable(f"the {name} {k} backend's kernel is not built")
    return Backends(
        ATTENTION[chosen["attention"]](),
        MOE[chosen["moe"]](),
        NORM[chosen["norm"]](),
        LAYER[chosen["layer"]](),
        reasons,
    )
