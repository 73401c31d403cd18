"""select_backends: one choice per engine from device, dtype and the built kernels, overridable by
name; and a model's after_load hands every module its backend."""

from __future__ import annotations

import pytest
import torch

from llm_core.backends import selector
from llm_core.backends.selector import BackendUnavailable, reference_backends, select_backends
from llm_core.kernels import cpu_attention, cpu_layer, cpu_moe, cpu_norm
from llm_core.models.checkpoint import LoadedLLM
from llm_core.models.decoder import MiMoAttention, RMSNorm
from llm_core.models.moe import GroupedExperts, TopKRouter

ALL_CPU = {"attention": "cpu", "moe": "cpu", "norm": "cpu", "layer": "cpu"}
ALL_TORCH = {"attention": "torch", "moe": "torch", "norm": "torch", "layer": "none"}


@pytest.mark.skipif(
    not (cpu_attention.AVAILABLE and cpu_layer.AVAILABLE and cpu_moe.AVAILABLE and cpu_norm.AVAILABLE),
    reason="the C kernels are not built",
)
def test_cpu_fp32_takes_the_c_kernels() -> None:
    assert select_backends("cpu", torch.float32).names() == ALL_CPU


def test_other_dtypes_and_devices() -> None:
    # bf16 on CPU: the layer kernel (bf16 storage, float32 compute); the per-op kernels are fp32 only
    bf16_layer = "cpu" if cpu_layer.AVAILABLE else "none"
    assert select_backends("cpu", torch.bfloat16).names() == {**ALL_TORCH, "layer": bf16_layer}
    assert select_backends("cpu", torch.float16).names() == ALL_TORCH
    assert select_backends(torch.device("cuda"), torch.bfloat16).names() == {
        **ALL_TORCH,
        "attention": "triton",
    }
    assert reference_backends().names() == ALL_TORCH


def test_a_missing_kernel_falls_back_and_an_override_of_it_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_attention, "AVAILABLE", False)
    names = select_backends("cpu", torch.float32).names()
    assert names["attention"] == "torch" and names["layer"] == "none"  # the layer kernel needs C attention
    with pytest.raises(BackendUnavailable, match="not built"):
        select_backends("cpu", torch.float32, attention="cpu")
    with pytest.raises(BackendUnavailable, match="unknown attention backend 'flash'"):
        select_backends("cpu", torch.float32, attention="flash")


@pytest.mark.skipif(not cpu_layer.AVAILABLE, reason="the C decoder-layer kernel is not built")
def test_overrides() -> None:
    names = select_backends("cpu", torch.float32, attention="torch").names()
    assert names["attention"] == "torch" and names["layer"] == "none"
    assert select_backends("cpu", torch.float32, layer="none").names()["layer"] == "none"
    assert select_backends("cpu", torch.float32, moe="torch").names()["moe"] == "torch"
    assert selector.LAYER.keys() == {"none", "cpu"}


def test_after_load_gives_every_module_the_chosen_backend(loaded: LoadedLLM) -> None:
    model = loaded.model
    chosen = model.backends
    assert chosen.names() == select_backends("cpu", torch.float32).names()
    for module in model.modules():
        if isinstance(module, RMSNorm):
            assert module.backend is chosen.norm
        elif isinstance(module, MiMoAttention):
            assert module.backend is chosen.attention and module.qkv_weight is not None
        elif isinstance(module, (TopKRouter, GroupedExperts)):
            assert module.backend is chosen.moe
