"""Smoke run of ``python -m bench.encoder_forward --quick``: it runs and writes its summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import encoder_forward


def test_quick_run_writes_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_HOME", str(tmp_path / "home"))
    out = tmp_path / "enc.json"
    assert encoder_forward.main(["--quick", "--threads", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    summary = doc["summary"]
    assert summary["ceiling_images_per_s"] > 0
    assert (
        summary["ceiling_images_per_s"]
        == max(summary["bs1_patches_per_s"], summary["budget_patches_per_s"])
        / (summary["image_size"] // 14) ** 2
    )
    assert doc["machine"]["cpu_cores"] >= 1
    assert {r["case"] for r in doc["results"]} >= {"bs1", "batcher"}
