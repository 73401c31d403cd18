"""``bench.vlm_peer``: its summary arithmetic and Zipf draws, and a ``--quick`` run end to end (vLLM
alone, epd in front of the same vLLM and epd alone on the benchmark's generated Qwen2.5-VL
checkpoint, every workload and the open loop, a few requests each; needs the vLLM peer, ``make
vllm-peer``; a few minutes, most of it vLLM's start-up)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.loadgen import LoadResult, Outcome
from bench.vlm_peer import SIDES, WORKLOADS, Answer, Phase, aggregate, main, summarize
from epd.llm_servers.vllm_launch import peer_python


def _phase(side: str, workload: str, latencies: list[float], repeat: int = 0) -> Phase:
    outcomes = [Outcome(i, 0.0, lat, 200, None, None, {}) for i, lat in enumerate(latencies)]
    answers = {i: Answer("same", 16, 100) for i in range(len(latencies))}
    result = LoadResult("closed", 16.0, outcomes, max(latencies))
    return Phase(side, workload, "closed", repeat, result, answers, {"x": 1.0}, 0.0, None, (0.0, 0.0))


def test_summary_ratios_are_epd_over_vllm() -> None:
    phases = []
    for w in WORKLOADS:
        phases += [
            _phase("vllm", w, [1.0] * 4),
            _phase("epd+vllm", w, [0.5] * 4),
            _phase("epd", w, [2.0] * 4),
        ]
    records = [aggregate([p]) for p in phases]
    s = summarize(records, ceiling_images_per_s=40.0)
    assert s["qps_ratio_cold"] == pytest.approx(2.0) and s["p90_ratio_cold"] == pytest.approx(0.5)
    assert s["qps_ratio_zipf"] == pytest.approx(2.0) and s["text_qps_ratio"] == pytest.approx(2.0)
    assert s["epd_qps_ratio_cold"] == pytest.approx(0.5)
    assert s["forward_fraction"] == pytest.approx(4.0 / 40.0)  # vllm cold QPS / forward-only images/s
    # no "given embeds" / "encode only" phases here: no ideal split, so no cold QPS verdict
    assert s["ideal_split_ratio_cold"] is None
    assert s["targets_met"] == {
        "qps_ratio_cold>=max(1,0.9*ideal)": None,
        "p90_ratio_cold<=1": True,
        "qps_ratio_zipf>=1.5": True,
        "text_qps_ratio>=0.95": True,
        "open_p90_ratio_cold<=0.5": None,
    }


def test_the_ideal_split_is_the_two_halves_in_series() -> None:
    phases = [_phase("vllm", "cold", [1.0] * 4), _phase("epd+vllm", "cold", [0.8] * 4)]
    phases += [_phase("vllm given embeds", "cold", [0.5] * 4), _phase("epd encode only", "cold", [1 / 3] * 4)]
    s = summarize([aggregate([p]) for p in phases], ceiling_images_per_s=None)
    # the LM side alone 2x vLLM's QPS, the encode side 3x: in series 1 / (1/2 + 1/3) = 1.2x
    assert s["ideal_split_ratio_cold"] == pytest.approx(1.2)
    assert s["targets_met"]["qps_ratio_cold>=max(1,0.9*ideal)"] is True  # 1.25 >= 1.08


@pytest.mark.vllm
@pytest.mark.skipif(peer_python() is None, reason="vLLM peer not installed (make vllm-peer)")
def test_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "vlm_peer.json"
    assert main(["--quick", "--json", str(out), "--log-dir", str(tmp_path / "logs")]) == 0
    doc = json.loads(out.read_text())
    summary, results = doc["summary"], doc["results"]
    for key in (
        "qps_ratio_cold",
        "p90_ratio_cold",
        "qps_ratio_zipf",
        "text_qps_ratio",
        "forward_fraction",
        "ideal_split_ratio_cold",
    ):
        assert isinstance(summary[key], float) and summary[key] > 0, key
    assert summary["errors"] == 0
    rows = {(r["side"], r["workload"], r["mode"]) for r in results}
    assert rows >= {(s, w, "closed") for s in SIDES for w in WORKLOADS}
    assert rows >= {(s, "cold", "open") for s in SIDES}
    for r in results:  # greedy answers of the requested length on every side (no early eos)
        assert r["side"] == "epd encode only" or r["completion_tokens_mean"] == 16, r
    assert summary["vllm_given_embeds_cold_qps"] > 0 and summary["epd_encode_only_cold_qps"] > 0
    # epd's answers carry its media info (a cold image is never a hit); vLLM's carry none
    cold = {r["side"]: r for r in results if r["workload"] == "cold" and r["mode"] == "closed"}
    assert cold["epd+vllm"]["epd_cache_hit_share"] == 0.0 and cold["vllm"]["epd_cache_hit_share"] is None
    assert {"vllm api", "vllm engine"} <= set(cold["vllm"]["cpu_ms_per_request_by_role"])
