"""Segment planning, sampled-frame decoding (in-process and pooled) and shared-memory hygiene."""

from __future__ import annotations

import os

import numpy as np
import pytest

from media_io.config import PreprocessConfig
from media_io.errors import BadMedia
from media_io.preprocess import get_backend
from media_io.video import decode_video
from media_io.video_decode import SHM_PREFIX, SegmentDecodeError, decode_in_pool
from media_io.video_plan import Run, Segment, Target, plan_runs, split_segments
from media_io.video_probe import scan_video
from media_io.video_sampling import sample_frame_indices, target_size
from tests.fixtures.video_factory import make_clip, make_vfr_clip, read_barcode
from tests.media_io import bad_video
from tests.media_io.configs import CONFIGS


def _our_segments() -> set[str]:
    mine = f"{SHM_PREFIX}_{os.getpid()}_"
    return {n for n in os.listdir("/dev/shm") if n.startswith(mine)}


@pytest.fixture(scope="module")
def gop_clip() -> bytes:
    # 12 s at 10 fps, a keyframe every 15 frames, B-frames: decode order != display order
    return make_clip(160, 120, fps=10.0, seconds=12.0, keyint=15, bframes=2)


def test_runs_cover_every_slot_once_and_start_at_keyframes(gop_clip: bytes) -> None:
    table = scan_video(gop_clip).table
    indices = sample_frame_indices(len(table.pts), 10.0)
    runs = plan_runs(table, indices)
    slots = [t.slot for r in runs for t in r.targets]
    assert slots == list(range(len(indices)))
    keys = set(table.keyframe_pts.tolist())
    for run in runs:
        assert run.keyframe_pts in keys
        assert all(run.keyframe_pts <= t.pts for t in run.targets)
        # no keyframe between the run's keyframe and its targets: it is the nearest one
        assert not any(run.keyframe_pts < k <= run.targets[-1].pts for k in keys)
        assert run.cost >= 1
    assert runs[0].seek


@pytest.mark.parametrize("n", [1, 2, 3, 7, 100])
def test_segments_are_contiguous_and_balanced(gop_clip: bytes, n: int) -> None:
    table = scan_video(gop_clip).table
    runs = plan_runs(table, sample_frame_indices(len(table.pts), 10.0))
    segments = split_segments(runs, n)
    assert 1 <= len(segments) <= min(n, len(runs))
    flat = [r._replace(seek=False) for s in segments for r in s.runs]
    assert flat == [r._replace(seek=False) for r in runs]  # same runs, same order
    assert all(s.runs[0].seek for s in segments)  # a worker starts with a fresh decoder
    biggest_run = max(r.cost for r in runs)
    fair = sum(r.cost for r in runs) / len(segments)
    assert max(s.cost for s in segments) <= fair + biggest_run


@pytest.mark.parametrize(
    ("keyint", "bframes"),
    [(1, 0), (4, 0), (15, 2), (250, 3)],
    ids=["intra", "short-gop", "bframes", "one-gop"],
)
def test_decoded_frames_are_the_sampled_source_frames(keyint: int, bframes: int) -> None:
    data = make_clip(160, 120, fps=12.0, seconds=5.0, keyint=keyint, bframes=bframes)
    out = decode_video(data, workers=1)
    assert out.indices == sample_frame_indices(60, 12.0)
    assert [read_barcode(f) for f in out.frames] == out.indices
    assert out.timestamps == pytest.approx([i / 12.0 for i in out.indices], abs=1e-3)
    h, w = target_size(120, 160, len(out.indices), PreprocessConfig())
    assert out.frames.shape[1:] == (h, w, 3)
    assert h * w >= PreprocessConfig().video_min_pixels  # 160x120 is raised to the video minimum


def test_variable_frame_rate_picks_frames_by_timestamp() -> None:
    stamps = [0, 40, 50, 300, 310, 320, 900, 1400, 1450, 1700, 2500, 2600, 3100, 3150]
    data = make_vfr_clip(stamps, 160, 120, keyint=4)
    out = decode_video(data, workers=1)
    info = out.info
    assert out.indices == sample_frame_indices(info.num_frames, info.fps)
    assert [read_barcode(f) for f in out.frames] == out.indices
    assert out.timestamps == pytest.approx([stamps[i] / 1000 for i in out.indices], abs=1e-3)


def test_pool_and_in_process_decode_agree_and_leave_no_shared_memory(gop_clip: bytes) -> None:
    before = _our_segments()
    seen: list[tuple[int, int]] = []
    pooled = decode_video(gop_clip, workers=2, progress=lambda done, total: seen.append((done, total)))
    local = decode_video(gop_clip, workers=1)
    assert pooled.indices == local.indices
    np.testing.assert_array_equal(pooled.frames, local.frames)
    assert [read_barcode(f) for f in pooled.frames] == pooled.indices
    assert _our_segments() == before
    total = len(pooled.indices)
    assert seen and seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    # the returned frames outlive the (unlinked) segment and stay writable
    pooled.frames[0, 0, 0] = 7
    assert pooled.frames[0, 0, 0, 0] == 7


def test_worker_failure_raises_and_unlinks_segments(gop_clip: bytes) -> None:
    table = scan_video(gop_clip).table
    first, last_key = int(table.pts[0]), int(table.keyframe_pts[-1])
    good = Segment((Run(first, (Target(first, 0),), True, 1),))
    bad = Segment((Run(last_key, (Target(last_key, 5),), True, 1),))  # slot 5 of a 2-frame output
    before = _our_segments()
    with pytest.raises(SegmentDecodeError, match="IndexError"):
        decode_in_pool(gop_clip, [good, bad], (2, 56, 56, 3), workers=2)
    assert _our_segments() == before
    # the pool survives a failed task
    out = decode_video(gop_clip, workers=2)
    assert [read_barcode(f) for f in out.frames] == out.indices


def test_corrupt_data_in_a_worker_is_bad_media_and_unlinks_segments() -> None:
    before = _our_segments()
    with pytest.raises(BadMedia, match="cannot decode") as err:
        decode_video(bad_video.corrupt_payload(), item="noise.mp4", workers=2)
    assert err.value.item == "noise.mp4"
    assert _our_segments() == before


def test_in_process_progress_counts_every_frame(gop_clip: bytes) -> None:
    seen: list[tuple[int, int]] = []
    out = decode_video(gop_clip, workers=1, progress=lambda d, t: seen.append((d, t)))
    n = len(out.indices)
    assert seen == [(i, n) for i in range(1, n + 1)]


def test_swscale_resize_mode_picks_the_same_frames(gop_clip: bytes) -> None:
    exact = decode_video(gop_clip, workers=1)
    fast = decode_video(gop_clip, workers=1, resize="swscale")
    assert fast.frames.shape == exact.frames.shape
    assert [read_barcode(f) for f in fast.frames] == exact.indices


def test_total_pixel_budget_shrinks_the_frames() -> None:
    data = make_clip(640, 480, fps=10.0, seconds=2.0, keyint=10)
    full = decode_video(data, workers=1)
    budget = PreprocessConfig(video_total_pixels=300_000)
    small = decode_video(data, budget, workers=1)
    assert small.indices == full.indices
    h, w = small.frames.shape[1:3]
    assert h * w <= 300_000 * 2 // len(small.indices) < full.frames.shape[1] * full.frames.shape[2]
    assert [read_barcode(f) for f in small.frames] == small.indices


def test_mimo_rule_decodes_its_frames_with_a_timestamp_per_pair() -> None:
    # 10 s at 10 fps = 100 frames; MiMo-V2.5 samples 10 at 1 fps, at i * 99 / 9 = 11 i, and times
    # each pair by its first frame: 0, 22, 44, 66, 88 over 10 fps.
    data = make_clip(160, 120, fps=10.0, seconds=10.0, keyint=7, bframes=2)
    mimo = CONFIGS["mimo_v25"]
    out = decode_video(data, mimo, workers=1)
    assert out.indices == list(range(0, 100, 11))
    assert [read_barcode(f) for f in out.frames] == out.indices
    assert out.pair_timestamps == pytest.approx([0.0, 2.2, 4.4, 6.6, 8.8])
    # 120x160 rounded to multiples of 32 (3.75 -> 4, 5): 128x160; patches (5, 8, 10) of 1536
    assert out.frames.shape == (10, 128, 160, 3)
    patches = get_backend("cpu", mimo).video(out.frames)
    assert patches.grid_thw == (5, 8, 10) and patches.pixel_values.shape == (400, 1536)
    assert len(out.pair_timestamps) == patches.grid_thw[0]
    # the Qwen2-VL rule on the same clip: 2 fps, arange(0, 100, 5), one time per pair too
    qwen = decode_video(data, workers=1)
    assert qwen.indices == list(range(0, 100, 5))
    assert qwen.pair_timestamps == pytest.approx([i / 10.0 for i in range(0, 100, 10)])


@pytest.mark.slow
def test_pool_workers_exit_when_their_owner_is_killed() -> None:
    """kill -9 of the process that owns the pool leaves no decoder processes behind."""
    import signal
    import subprocess
    import sys
    import time

    code = (
        "import sys, time\n"
        "from media_io.video_decode import warm_pool\n"
        "print(' '.join(map(str, sorted(warm_pool(2)))), flush=True)\n"
        "time.sleep(120)\n"
    )
    # stderr muted: the killed owner's resource tracker reports its leaked semaphores there
    owner = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        assert owner.stdout is not None
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert pids and all(_alive(p) for p in pids)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    deadline = time.monotonic() + 15.0
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
