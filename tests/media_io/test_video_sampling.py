"""Frame sampling and target size against transformers' Qwen2VLVideoProcessor."""

from __future__ import annotations

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
    sample_frame_indices,
    target_size,
)

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
