"""Backends.paths: /health's ``paths`` derived from the backends the selector chose, each stand-in
named with its reason."""

from __future__ import annotations

import pytest
import torch

from epd_common.active_paths import report
from llm_core.backends import selector
from llm_core.backends.selector import select_backends
from llm_core.kernels import cpu_layer


@pytest.mark.skipif(not cpu_layer.AVAILABLE, reason="the C decoder layer is not built")
def test_cpu_fp32_runs_the_layer_kernel() -> None:
    r = report(select_backends("cpu", torch.float32).paths())
    assert r["paths"]["layer"].startswith("one C call per layer")
    assert f"{torch.get_num_threads()} threads" in r["paths"]["layer"]
    assert r["paths"]["attention"].startswith("C paged attention")
    assert r["paths"]["moe"].startswith("C experts and router")
    assert r["fallbacks"] == []


def test_an_override_is_what_runs_and_no_fallback() -> None:
    r = report(select_backends("cpu", torch.float32, layer="none", moe="torch").paths())
    assert r["paths"]["layer"].startswith("the model's modules")
    assert r["paths"]["moe"] == "torch"
    assert r["fallbacks"] == []  # asked for, not a stand-in


def test_unbound_sgemm_is_a_named_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_layer, "AVAILABLE", False)  # the extension loaded, the binding did not
    r = report(select_backends("cpu", torch.float32).paths())
    assert r["paths"]["layer"].startswith("the model's modules")
    if cpu_layer.BUILT:
        assert r["fallbacks"] == ["layer: torch's sgemm_ could not be bound from libtorch_cpu"]


def test_other_dtypes_and_devices() -> None:
    r = report(select_backends("cpu", torch.bfloat16).paths())
    assert "attention: the per-op C kernels are float32 only and the weights are bfloat16" in r["fallbacks"]
    assert not any(f.startswith("layer:") for f in r["fallbacks"]) or not cpu_layer.AVAILABLE
    r = report(select_backends("cpu", torch.float16).paths())
    why = "layer: the layer kernel stores float32 or bfloat16 only and the weights are float16"
    assert why in r["fallbacks"] or not cpu_layer.AVAILABLE
    r = report(select_backends("cuda", torch.bfloat16).paths())
    assert r["paths"]["attention"].startswith("Triton") and r["fallbacks"] == []


def test_a_missing_kernel_names_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        selector.__dict__, "_built", lambda kind, name: not (kind == "norm" and name == "cpu")
    )
    r = report(select_backends("cpu", torch.float32).paths())
    assert r["paths"]["norm"] == "torch"
    assert any(f.startswith("norm: ") for f in r["fallbacks"]), r["fallbacks"]
