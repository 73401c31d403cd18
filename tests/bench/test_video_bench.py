"""bench.video: its single passes do what its rows say, its floors decode every frame once, and a
short run writes a summary whose ratios are against the rows the docstring names."""

from __future__ import annotations

import io
import json
from pathlib import Path

import av
import numpy as np
import pytest

from bench.video import (
    SLICES,
    SamplePlan,
    _decode_range,
    floor_ranges,
    main,
    make_clip,
    sample_plan,
    single_pass,
)
from media_io.config import PreprocessConfig
from media_io.video import decode_video
from media_io.video_probe import scan_video
from tests.fixtures.video_factory import make_clip as make_barcoded_clip
from tests.fixtures.video_factory import read_barcode


@pytest.fixture(scope="module")
def clip() -> bytes:
    # 60 frames, a keyframe every 7: 9 GOPs; 2 fps of 10 fps samples every 5th frame
    return make_barcoded_clip(320, 240, fps=10.0, seconds=6.0, keyint=7)


def _plan(data: bytes) -> SamplePlan:
    info, _ = scan_video(data)
    return sample_plan(info.num_frames, info.fps, (info.height, info.width), PreprocessConfig())


@pytest.mark.parametrize(
    ("thread_type", "threads", "sws"),
    [("SLICE", 1, False), ("SLICE", 2, False), ("FRAME", 2, False), (None, None, False), ("SLICE", 1, True)],
)
def test_sampled_pass_converts_only_the_sampled_frames(
    clip: bytes, thread_type: str | None, threads: int | None, sws: bool
) -> None:
    plan = _plan(clip)
    assert 0 < len(plan.indices) < plan.num_frames and plan.indices[-1] < plan.num_frames - 1

    result = single_pass(
        clip, plan, convert="sampled", thread_type=thread_type, threads=threads, cached_converter=sws
    )

    assert result.converted == len(plan.indices)
    assert result.decoded == plan.indices[-1] + 1  # stops after the last sampled frame, as transformers
    assert result.frames is not None
    assert [read_barcode(f) for f in result.frames] == list(plan.indices)
    np.testing.assert_array_equal(result.frames, decode_video(clip, workers=1).frames)


def test_convert_all_pass_converts_every_frame_and_none_pass_converts_none(clip: bytes) -> None:
    plan = _plan(clip)
    sampled = single_pass(clip, plan, convert="sampled", threads=1)
    every = single_pass(clip, plan, convert="all")
    none = single_pass(clip, plan, convert="none", thread_type="SLICE", threads=2)

    assert every.decoded == every.converted == plan.num_frames
    assert every.frames is not None and sampled.frames is not None
    np.testing.assert_array_equal(every.frames, sampled.frames)
    assert none.frames is None and none.converted == 0 and none.decoded == plan.num_frames


@pytest.mark.parametrize("segments", [1, 2, 3, 4, 20])
def test_floor_ranges_decode_every_frame_once(clip: bytes, segments: int, tmp_path: Path) -> None:
    _, table = scan_video(clip)
    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)

    ranges = floor_ranges(table, segments)

    starts = [s for s, _ in ranges]
    assert starts[0] == table.pts[0] and set(starts) <= set(table.keyframe_pts.tolist())
    assert starts == sorted(set(starts))
    assert [e for _, e in ranges] == [*starts[1:], None]
    assert len(ranges) == min(segments, len(table.keyframe_pts))
    counts = [_decode_range(str(path), s, e) for s, e in ranges]
    assert sum(counts) == len(table.pts)
    if len(ranges) > 1:  # similar lengths: no range more than one GOP (7 frames) off its share
        assert max(counts) - min(counts) <= 7


def _slices_per_frame(data: bytes) -> set[int]:
    """Coded slices (NAL types 1 and 5) per packet of an MP4's H.264 stream."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        extradata = stream.codec_context.extradata
        assert extradata is not None and extradata[0] == 1  # avcC: length-prefixed NAL units
        size = (extradata[4] & 3) + 1
        counts: set[int] = set()
        for packet in container.demux(stream):
            raw, pos, n = bytes(packet), 0, 0
            while pos + size <= len(raw):
                length = int.from_bytes(raw[pos : pos + size], "big")
                n += (raw[pos + size] & 0x1F) in (1, 5)
                pos += size + length
            if raw:
                counts.add(n)
    return counts


@pytest.mark.timeout(300)
def test_short_run_summary_is_against_the_named_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_BENCH_CACHE", str(tmp_path))
    out = tmp_path / "video.json"
    # 0.2 min = 360 frames: two GOPs, so ours really goes through the pool
    summary = main(["--minutes", "0.2", "--repeats", "1", "--workers", "2", "--json", str(out)])

    doc = json.loads(out.read_text())
    assert doc["summary"] == json.loads(json.dumps(summary))
    rows = {r["variant"]: r for r in doc["results"]}
    passes = {"pass-1thread", "pass-slice(2)", "pass-frame(2)"}
    assert set(rows) == passes | {p + "+sws" for p in passes} | {
        "convert-all",
        "ours-1proc",
        "ours-pool(2)",
        "floor-slice(2)",
        "floor-pool(2)",
    }
    assert summary["outputs_identical"] and summary["floors_decoded_every_frame"]
    for name, row in rows.items():
        if row["kind"] == "floor":
            assert row["frames_decoded"] == 360 and row["max_abs_diff_vs_naive"] is None, name
        else:
            assert row["max_abs_diff_vs_naive"] == 0, name

    def p50(name: str) -> float:
        return float(rows[name]["p50_s"])

    ours = p50("ours-pool(2)")
    assert summary["speedup_vs_naive"] == pytest.approx(p50("pass-1thread") / ours)
    assert summary["speedup_per_core"] == pytest.approx(summary["speedup_vs_naive"] / summary["cores"])
    threaded = min(("pass-slice(2)", "pass-frame(2)"), key=p50)
    assert summary["threaded_baseline"] == threaded
    assert summary["speedup_vs_threaded"] == pytest.approx(p50(threaded) / ours)
    threaded_sws = min(("pass-slice(2)+sws", "pass-frame(2)+sws"), key=p50)
    assert summary["threaded_baseline_sws"] == threaded_sws
    assert summary["speedup_vs_threaded_sws"] == pytest.approx(p50(threaded_sws) / ours)
    assert summary["speedup_vs_naive_sws"] == pytest.approx(p50("pass-1thread+sws") / ours)
    floor = min(("floor-slice(2)", "floor-pool(2)"), key=p50)
    assert summary["decode_floor_variant"] == floor and summary["decode_floor_s"] == pytest.approx(p50(floor))
    assert summary["ours_vs_decode_floor"] == pytest.approx(ours / p50(floor))
    assert summary["speedup_bound_vs_naive"] == pytest.approx(p50("pass-1thread") / p50(floor))
    assert summary["meets_targets"] == (
        summary["speedup_per_core"] >= summary["target_speedup_per_core"]
        and summary["speedup_vs_threaded"] >= summary["target_speedup_vs_threaded"]
    )
    # The clip is the same on any machine: x264 wrote SLICES slices per frame.
    clip = next(tmp_path.glob("clip_*_sl2_0.2min_s0.mp4"))
    assert clip == make_clip(0.2, 0)
    assert _slices_per_frame(clip.read_bytes()) == {SLICES}
