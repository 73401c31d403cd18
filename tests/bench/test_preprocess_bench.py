"""bench.common helpers and a smoke run of ``python -m bench.preprocess --quick``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.common import machine_info, percentile, percentiles, write_json


def test_percentiles_match_numpy_linear_interpolation() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = rng.exponential(size=n).tolist()
        p = percentiles(xs)
        np.testing.assert_allclose([p.p50, p.p90, p.p99], np.percentile(xs, [50, 90, 99]))
        assert p.n == n and p.mean == pytest.approx(float(np.mean(xs)))
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_write_json_has_summary_and_machine(tmp_path: Path) -> None:
    out = tmp_path / "sub" / "r.json"
    write_json(out, summary={"ratio": 2.0, "nan": float("nan")}, results=[{"a": (1, 2)}], config={"p": out})
    doc = json.loads(out.read_text())
    assert doc["summary"] == {"ratio": 2.0, "nan": None}
    assert doc["results"] == [{"a": [1, 2]}] and doc["config"] == {"p": str(out)}
    assert doc["machine"]["cpu_cores"] >= 1 and "torch_threads" in doc["machine"]
    assert write_json(None, summary={}) is None
    assert machine_info()["cpu_model"]


def test_bench_preprocess_quick_smoke(tmp_path: Path) -> None:
    from bench.preprocess import main

    out = tmp_path / "pre.json"
    summary = main(["--quick", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["summary"] == json.loads(json.dumps(summary))
    assert summary["speedup_vs_transformers"] > 0
    # The bench checks parity as it goes: cpu output equals transformers' up to resampling noise.
    assert summary["max_abs_diff_cpu"] <= 0.15
    latency = {r["method"] for r in doc["results"] if r["phase"] == "latency"}
    assert latency == {"transformers", "transformers-pil", "cpu", "cpu-nodraft", "dali"}
    throughput = [r for r in doc["results"] if r["phase"] == "throughput"]
    assert {r["method"] for r in throughput} >= {
        "transformers",
        "transformers batch",
        "transformers pool",
        "transformers-pil pool",
        "cpu",
        "cpu 1 thread",
        "floor: decode+resize",
    }
    # Every ratio is against the fastest transformers row, which therefore reads 1.0, and that
    # row is the one the summary names.
    fastest = max(
        (r for r in throughput if r["method"].startswith("transformers")), key=lambda r: r["images_per_s"]
    )
    assert fastest["speedup"] == 1.0
    assert summary["throughput_baseline_by_size"] == {fastest["size"]: fastest["method"]}
    # The floor row's time is the unit of the floor column, and the summary's ratio is ours over it.
    (floor,) = [r for r in throughput if r["method"] == "floor: decode+resize"]
    (cpu,) = [r for r in throughput if r["method"] == "cpu"]
    assert floor["x_floor_time"] == 1.0
    assert summary["floor_ratio"] == pytest.approx(
        floor["images_per_s"]
        / max(
            cpu["images_per_s"], next(r["images_per_s"] for r in throughput if r["method"] == "cpu 1 thread")
        )
    )
    assert summary["meets_target"] == all(summary["meets_target_by_size"].values())
