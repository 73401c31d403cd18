"""Frame sampling and target size: Qwen2-VL's rule against transformers' Qwen2VLVideoProcessor,
MiMo-V2.5's against values worked out by hand from its documented rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.video_utils import VideoMetadata

from media_io.config import PreprocessConfig
from media_io.preprocess.resize import smart_resize
from media_io.video_sampling import (
    frame_pixel_cap,
    num_sampled_frames,
    pair_timestamps,
    sample_frame_indices,
    target_size,
)
from tests.media_io.configs import CONFIGS

REF = Qwen2VLVideoProcessor()


def _reference_indices(total: int, fps: float) -> list[int]:
    """The reference's indices, less any past the last frame (its PyAV loader never reaches them)."""
    meta = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)
    return [int(i) for i in REF.sample_frames(meta, fps=2.0).tolist() if i < total]


@settings(max_examples=120, deadline=None)
@given(
    total=st.integers(min_value=2, max_value=30 * 60 * 60),
    fps=st.sampled_from([1.0, 5.0, 10.0, 23.976, 24.0, 25.0, 29.97, 30.0, 50.0, 59.94, 60.0, 120.0])
    | st.floats(min_value=0.5, max_value=240.0, allow_nan=False),
)
def test_indices_match_reference(total: int, fps: float) -> None:
    ours = sample_frame_indices(total, fps)
    assert ours == _reference_indices(total, fps)


@settings(max_examples=80, deadline=None)
@given(total=st.integers(min_value=2, max_value=200_000), fps=st.floats(min_value=0.5, max_value=240.0))
def test_index_invariants(total: int, fps: float) -> None:
    cfg = PreprocessConfig()
    indices = sample_frame_indices(total, fps, cfg)
    count = num_sampled_frames(total, fps, cfg)
    assert count % cfg.temporal_patch_size == 0
    # The reference's float arange can yield one index more than the count it computed
    # (total=99 at 1 fps: 98 -> 99 indices); we keep its indices, patchify pads the odd one.
    assert len(indices) in (count, count + 1)
    assert count <= cfg.max_frames
    assert count >= min(cfg.min_frames, total - total % 2)
    assert all(0 <= i < total for i in indices)
    assert indices == sorted(set(indices))  # strictly increasing: no frame twice


def test_two_fps_rule_on_common_clips() -> None:
    # 10 s at 30 fps -> 20 frames, one every 15
    assert sample_frame_indices(300, 30.0) == list(range(0, 300, 15))
    # 1 s at 30 fps -> 2 frames at 2 fps, raised to min_frames=4
    assert sample_frame_indices(30, 30.0) == [0, 7, 15, 22]
    # 1 hour at 30 fps -> clamped to 768
    assert len(sample_frame_indices(108_000, 30.0)) == 768


def test_index_past_the_end_is_dropped() -> None:
    meta = VideoMetadata(total_num_frames=535, fps=34.0, duration=535 / 34.0)
    assert int(REF.sample_frames(meta, fps=2.0)[-1]) == 535  # the reference's overshoot
    assert sample_frame_indices(535, 34.0)[-1] == 517


def test_too_short_video_takes_every_frame() -> None:
    # The reference cannot sample one frame (it divides by zero); we take it and patchify pads.
    assert sample_frame_indices(1, 30.0) == [0]
    assert sample_frame_indices(3, 30.0) == [0, 1]


@pytest.mark.parametrize(
    ("height", "width", "frames"),
    [(240, 320, 4), (240, 320, 64), (720, 1280, 8), (720, 1280, 400), (1080, 1920, 768), (100, 3000, 16)],
)
@pytest.mark.parametrize("max_video_tokens", [128_000, 2_000, 500])
def test_target_size_matches_reference_resize(
    height: int, width: int, frames: int, max_video_tokens: int
) -> None:
    """Our size equals what the reference's resize (cap_pixels_per_frame=True) produces."""
    cfg = PreprocessConfig(video_total_pixels=int(max_video_tokens * 28 * 28 * 0.9))
    ref = Qwen2VLVideoProcessor(max_video_tokens=max_video_tokens)
    # the reference computes the size from the tensor's shape only: a zero-stride tensor is free
    videos = torch.zeros(1, 1, 3, 1, 1, dtype=torch.uint8).expand(1, frames, 3, height, width)
    ref_h, ref_w = _reference_size(ref, videos)
    assert target_size(height, width, frames, cfg) == (ref_h, ref_w)


def _reference_size(ref: Qwen2VLVideoProcessor, videos: torch.Tensor) -> tuple[int, int]:
    """The (height, width) the reference resize picks, computed by the reference's own rule."""
    from transformers.models.qwen2_vl import video_processing_qwen2_vl as mod

    seen: list[tuple[int, int]] = []
    original = mod.smart_resize

    def spy(*args, **kwargs):  # record the reference's decision, then let it resize nothing
        out = original(*args, **kwargs)
        seen.append(out)
        raise _Stop

    mod.smart_resize = spy
    try:
        ref.resize(
            videos,
            size=ref.size if not isinstance(ref.size, dict) else _size_dict(ref.size),
            resample=ref.resample,
            factor=28,
            temporal_factor=2,
            cap_pixels_per_frame=True,
        )
    except _Stop:
        pass
    finally:
        mod.smart_resize = original
    assert len(seen) == 1
    return seen[0]


class _Stop(Exception):
    pass


def _size_dict(size: dict) -> object:
    from transformers.image_processing_utils import SizeDict

    return SizeDict(**size)


def test_cap_never_below_floor_and_never_above_max() -> None:
    cfg = PreprocessConfig()
    for frames in (2, 64, 256, 512, 768):
        cap = frame_pixel_cap(frames, cfg)
        assert int(cfg.video_min_pixels * 1.05) <= cap <= cfg.video_max_pixels
    # a long video gets smaller frames than a short one
    assert frame_pixel_cap(768, cfg) < frame_pixel_cap(8, cfg)


def test_target_size_is_a_fixed_point() -> None:
    """Frames already at the target are not resized again by a later smart_resize."""
    cfg = PreprocessConfig()
    for h, w, t in [(240, 320, 8), (720, 1280, 8), (1080, 1920, 768)]:
        th, tw = target_size(h, w, t, cfg)
        assert th % 28 == 0 and tw % 28 == 0
        assert smart_resize(th, tw, 28, cfg.video_min_pixels, cfg.video_max_pixels) == (th, tw)


# ---- MiMo-V2.5 (video_sampling="mimo_v2") ----------------------------------------------------------
# Expected values below are worked out by hand from the documented rule (sglang's MiMo processor:
# count = total / video_fps * fps clamped to [8, 3600] and to total, floored to even; indices
# floor(i * (total - 1) / (count - 1)); pair time = first index of the pair / video_fps;
# per-frame cap max(min, min(max, total_budget * 2 // count))).

MIMO = CONFIGS["mimo_v25"]


def test_mimo_ten_second_clip_at_one_fps() -> None:
    # 10 s at 30 fps = 300 frames -> 10 frames; positions i * 299 / 9 = 0, 33.2, 66.4, 99.7, 132.9,
    # 166.1, 199.3, 232.6, 265.8, 299, floored.
    indices = sample_frame_indices(300, 30.0, MIMO)
    assert indices == [0, 33, 66, 99, 132, 166, 199, 232, 265, 299]
    # one timestamp per pair, its first frame: indices 0, 66, 132, 199, 265 over 30 fps
    assert pair_timestamps(indices, 30.0, MIMO) == pytest.approx([0.0, 2.2, 4.4, 199 / 30, 265 / 30])
    # the same 10 s at 1 fps: every frame, pairs at 0, 2, 4, 6, 8 s
    assert sample_frame_indices(10, 1.0, MIMO) == list(range(10))
    assert pair_timestamps(list(range(10)), 1.0, MIMO) == (0.0, 2.0, 4.0, 6.0, 8.0)


def test_mimo_caps_at_3600_frames() -> None:
    # 2 h at 1 fps = 7200 frames -> 7200 wanted, capped at 3600; i * 7199 / 3599 = 2i + i / 3599,
    # so every second frame and then the last one.
    indices = sample_frame_indices(7200, 1.0, MIMO)
    assert len(indices) == 3600 == num_sampled_frames(7200, 1.0, MIMO)
    assert indices == [*range(0, 7198, 2), 7199]
    stamps = pair_timestamps(indices, 1.0, MIMO)
    assert len(stamps) == 1800 and stamps[:3] == (0.0, 4.0, 8.0) and stamps[-1] == 7196.0
    assert num_sampled_frames(10 * 3600 * 30, 30.0, MIMO) == 3600  # 10 h at 30 fps


@pytest.mark.parametrize(
    ("total", "video_fps", "expected"),
    [
        # 11 frames at 1 fps: 11 is odd -> 10; i * 10 / 9 = 0, 1.1, ..., 8.9, 10
        (11, 1.0, [0, 1, 2, 3, 4, 5, 6, 7, 8, 10]),
        # 7 frames at 1 fps: 7 raised to min 8, cut to the 7 that exist, floored to 6; i * 6 / 5
        (7, 1.0, [0, 1, 2, 3, 4, 6]),
        # 3 s at 30 fps: 3 raised to min_frames 8; i * 89 / 7 = 0, 12.7, 25.4, 38.1, 50.9, 63.6, 76.3, 89
        (90, 30.0, [0, 12, 25, 38, 50, 63, 76, 89]),
        # 3 frames: 2 of them, the first and the last
        (3, 30.0, [0, 2]),
        # a single frame, which the reference rejects: it is taken (patchify pads the pair)
        (1, 30.0, [0]),
    ],
)
def test_mimo_odd_and_short_counts(total: int, video_fps: float, expected: list[int]) -> None:
    indices = sample_frame_indices(total, video_fps, MIMO)
    assert indices == expected
    stamps = pair_timestamps(indices, video_fps, MIMO)
    assert stamps == pytest.approx([i / video_fps for i in expected[::2]])
    assert len(stamps) == (len(indices) + 1) // 2


def test_mimo_per_frame_pixel_budget() -> None:
    # max(8192, min(8388608, 268435456 * 2 // n))
    assert frame_pixel_cap(10, MIMO) == 8388608  # 53687091 per frame: video_max_pixels binds
    assert frame_pixel_cap(64, MIMO) == 8388608  # exactly the max
    assert frame_pixel_cap(100, MIMO) == 5368709
    assert frame_pixel_cap(3600, MIMO) == 149130
    # a 1080p hour at 3600 frames: 2073600 px above 149130, scaled by sqrt(2073600 / 149130) =
    # 3.729 and floored to 32: 9.05 -> 9 x 32 = 288, 16.09 -> 16 x 32 = 512
    assert target_size(1080, 1920, 3600, MIMO) == (288, 512)
    assert target_size(1080, 1920, 10, MIMO) == (1088, 1920)  # under the cap: only rounded to 32
    # the floor is video_min_pixels itself (Qwen2-VL's is 1.05 x): 1e6 * 2 // 3600 = 555 -> 8192
    small = dataclasses.replace(MIMO, video_total_pixels=1_000_000)
    assert frame_pixel_cap(3600, small) == 8192
    assert frame_pixel_cap(3600, dataclasses.replace(small, video_sampling="qwen2_vl")) == int(8192 * 1.05)


def test_the_rule_is_the_configs_choice() -> None:
    # Same numbers, the other rule: Qwen2-VL's arange(0, 300, 30) instead of the linspace.
    qwen_rule = dataclasses.replace(MIMO, video_sampling="qwen2_vl")
    assert sample_frame_indices(300, 30.0, qwen_rule) == list(range(0, 300, 30))
    assert sample_frame_indices(300, 30.0, MIMO) != sample_frame_indices(300, 30.0, qwen_rule)
    with pytest.raises(ValueError, match="video_sampling"):
        dataclasses.replace(MIMO, video_sampling="qwen3_vl")  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(total=st.integers(min_value=1, max_value=30 * 60 * 120), fps=st.floats(min_value=0.5, max_value=240.0))
def test_mimo_index_invariants(total: int, fps: float) -> None:
    indices = sample_frame_indices(total, fps, MIMO)
    count = num_sampled_frames(total, fps, MIMO)
    assert count % 2 == 0 and count <= 3600
    assert len(indices) == (count or total)
    assert indices == sorted(set(indices)) and all(0 <= i < total for i in indices)
    if count:
        assert indices[0] == 0 and indices[-1] == total - 1  # linspace reaches both ends
        # at least 8 frames (or the even part of a shorter clip), at most one per second (or 8)
        assert count >= min(8, total - total % 2)
        assert count <= max(8.0, total / fps * MIMO.fps)
