"""Smoke run of bench.cache_hits on tiny inputs: it runs end to end and writes its summary."""

import json
from pathlib import Path

from bench.cache_hits import main


def test_cache_hits_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "cache_hits.json"
    argv = ["--requests", "400", "--media", "200", "--latency-reps", "5", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert 0.0 <= s["hit_rate_baseline"] <= s["hit_rate_ours"] <= 1.0
    assert s["hit_rate_gain"] >= 0.0 and s["read_1mib_p50_ms"] > 0
    assert {r["name"] for r in doc["results"]["hit_rates"]} >= {
        "ring + node cache (ours)",
        "rr + worker cache (baseline)",
    }
    assert doc["machine"]["cpu_cores"] >= 1
