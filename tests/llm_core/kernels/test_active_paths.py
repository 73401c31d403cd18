"""llm_paths: what runs the engine's layers, and every stand-in named with its reason."""

from __future__ import annotations

import pytest
import torch

from epd_common.active_paths import report
from llm_core.kernels import cpu_layer
from llm_core.kernels.active_paths import llm_paths


def test_cpu_fp32_runs_the_layer_kernel() -> None:
    r = report(llm_paths(torch.device("cpu"), torch.float32))
    assert r["paths"]["decoder_layer"].startswith("one C call per layer")
    assert f"{torch.get_num_threads()} threads" in r["paths"]["decoder_layer"]
    assert r["paths"]["attention"].startswith("C paged attention")
    assert r["fallbacks"] == []


def test_unbound_sgemm_is_a_named_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_layer, "AVAILABLE", False)  # the extension loaded, the binding did not
    r = report(llm_paths(torch.device("cpu"), torch.float32))
    assert r["paths"]["decoder_layer"] == "the model's torch modules"
    assert r["fallbacks"] == ["decoder_layer: torch's sgemm_ could not be bound from libtorch_cpu"]


def test_other_dtypes_and_devices() -> None:
    r = report(llm_paths(torch.device("cpu"), torch.bfloat16))
    assert r["fallbacks"] == ["layers: the C kernels are fp32 only and the weights are bfloat16"]
    r = report(llm_paths(torch.device("cuda"), torch.bfloat16))
    assert r["paths"]["attention"].startswith("Triton") and r["fallbacks"] == []
