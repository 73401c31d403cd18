"""bench.step_profile on a tiny checkpoint: every step kind is timed, the layer phases the C kernel
reports are filled in, and the columns add up to the step (the figures themselves are not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.step_profile import COLUMNS, main
from llm_core.kernels import cpu_layer
from tests.llm_core.conftest import build_tiny_mimo


@pytest.mark.skipif(not cpu_layer.AVAILABLE, reason="the C decoder layer is not built")
def test_a_short_profile_splits_each_step(tmp_path: Path) -> None:
    model = build_tiny_mimo(tmp_path / "model")
    out = tmp_path / "profile.json"
    argv = [
        "--model",
        str(model),
        "--concurrency",
        "2",
        "--chunks",
        "16",
        "--steps",
        "3",
        "--chunk-repeats",
        "2",
    ]
    assert main([*argv, "--prompt-tokens", "8", "--threads", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["concurrency"], r["chunk_tokens"]) for r in rows] == [(2, 0), (2, 16)]
    for r in rows:
        assert r["attention_ms"] > 0 and r["routed_experts_ms"] > 0 and r["qkv_proj_ms"] > 0
        assert sum(r[c + "_ms"] for c in COLUMNS) == pytest.approx(r["step_ms"], rel=1e-6)
