"""bench.audio: a short run (``--quick``: small widths, a 2.5 min clip of three 60 s segments, the
last one open-ended) writes the documented JSON, and ours gives the baseline's features, codes and
rows; the per-segment features are the whole-clip log-mel's rows, seams included."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.audio import main, segment_features, whole_clip_log_mel
from media_io.audio_config import AudioConfig


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_BENCH_CACHE", str(tmp_path_factory.getbasetemp() / "epd-bench"))


def test_segment_features_are_the_whole_clip_rows() -> None:
    cfg = AudioConfig()
    rng = np.random.default_rng(0)
    clip = rng.normal(0, 0.1, 3 * 24000 + 1234).astype(np.float32)
    ranges = [clip[:24000], clip[24000:48000], clip[48000:]]  # 1 s ranges, the last longer
    whole = whole_clip_log_mel(torch.from_numpy(clip), cfg)
    parts = [segment_features(ranges, k, cfg) for k in range(3)]
    assert [p.shape[0] for p in parts[:2]] == [100, 100]
    got = torch.cat(parts)
    assert got.shape == whole.shape
    assert float((got - whole).abs().max()) < 1e-4


def test_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "audio.json"
    summary = main(["--quick", "--workers", "2", "--json", str(out)])

    doc = json.loads(out.read_text())
    assert set(doc) == {"machine", "config", "results", "summary"}
    assert doc["summary"] == json.loads(json.dumps(summary))
    assert [r["row"] for r in doc["results"]] == ["single-pass", "ours", "floor-decode"]
    s = doc["summary"]
    for key in ("speedup_vs_single_pass", "speedup_per_core", "single_pass_s", "ours_s", "decode_floor_s"):
        assert s[key] > 0, key
    assert set(s["baseline_shares"]) == {"decode", "features", "encoder"}
    assert abs(sum(s["baseline_shares"].values()) - 1.0) < 1e-6
    assert {"p50", "p90", "p99"} <= set(s["segment_forward_s"]["ours"])
    # ours equals the baseline: every code, the rows to rounding, the features within the bound
    check = s["check"]
    assert s["outputs_match"] is True
    assert check["codes_equal_fraction"] == 1.0 and check["rows_with_other_codes"] == 0
    assert check["rows_max_abs_diff"] <= 1e-3 * check["row_scale"]
    assert check["mel_max_abs_diff"] <= s["tolerances"]["mel_abs"]
    assert check["rows"] == -(-150 * 25 // 4)  # 2.5 min: 6.25 rows per second (+ codec padding)
    assert s["decoded_samples_floor"] >= 150 * 44100
