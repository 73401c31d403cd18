"""Which frames of a video Qwen2-VL looks at, and at what size.

Both rules reproduce transformers' ``Qwen2VLVideoProcessor`` (``sample_frames`` and ``resize``),
so the frames we decode are the frames the reference would have picked:

- count: ``total / video_fps * fps`` (2 fps), clamped to ``[min_frames, max_frames]`` and to the
  frames that exist, then floored to a multiple of ``temporal_patch_size`` (an even count);
- indices: ``arange(0, total, total / count).int()``, i.e. evenly spaced by index. The decoder
  maps each index to that frame's presentation timestamp (see ``FrameTable``), so a variable
  frame rate clip still yields exactly the frames the reference would have indexed;
- size: ``smart_resize`` with ``video_min_pixels`` and a per-frame cap that is the smaller of
  ``video_max_pixels`` and an even share of ``video_total_pixels`` per temporal patch (floored at
  1.05 x ``video_min_pixels``): transformers' ``cap_pixels_per_frame=True`` rule, which bounds the
  total cost of long videos the way qwen-vl-utils does.

This module knows nothing of containers or decoding.
"""

from __future__ import annotations

import math

import torch

from media_io.config import PreprocessConfig
from media_io.preprocess.resize import smart_resize


def num_sampled_frames(
    total_frames: int, video_fps: float, cfg: PreprocessConfig = PreprocessConfig()
) -> int:
    """How many frames the 2 fps rule takes from a video of ``total_frames`` at ``video_fps``.

    Zero when the video has fewer frames than one temporal patch (the reference cannot sample
    those; :func:`sample_frame_indices` then takes every frame).
    """
    assert total_frames >= 0 and video_fps > 0, (total_frames, video_fps)
    tps = cfg.temporal_patch_size
    max_frames = math.floor(min(cfg.max_frames, total_frames) / tps) * tps
    count = total_frames / video_fps * cfg.fps
    count = min(max(count, cfg.min_frames), max_frames, total_frames)
    return math.floor(count / tps) * tps


def sample_frame_indices(
    total_frames: int, video_fps: float, cfg: PreprocessConfig = PreprocessConfig()
) -> list[int]:
    """Indices (display order, ascending) of the frames Qwen2-VL samples at ``cfg.fps``.

    Identical to ``Qwen2VLVideoProcessor.sample_frames(metadata, fps=cfg.fps)``, including its
    float ``arange`` (computed with torch exactly as the reference does). That arange can run one
    step long: an extra index below ``total_frames`` is kept (the count is then odd and patchify
    pads, as the reference does); one at ``total_frames`` or beyond names no frame and is dropped,
    as the reference's own PyAV loader drops it. A video shorter than one temporal patch, which
    the reference rejects, yields all its frames.
    """
    count = num_sampled_frames(total_frames, video_fps, cfg)
    if count == 0:
        return list(range(total_frames))
    indices = torch.arange(0, total_frames, total_frames / count).int()
    return [int(i) for i in indices.tolist() if i < total_frames]


def frame_pixel_cap(num_frames: int, cfg: PreprocessConfig = PreprocessConfig()) -> int:
    """The per-frame ``max_pixels`` for a video of ``num_frames`` sampled frames."""
    assert num_frames > 0, num_frames
    share = cfg.video_total_pixels * cfg.temporal_patch_size // num_frames
    return max(min(cfg.video_max_pixels, share), int(cfg.video_min_pixels * 1.05))


def target_size(
    height: int,
    width: int,
    num_frames: int,
    cfg: PreprocessConfig = PreprocessConfig(),
    item: str | None = None,
) -> tuple[int, int]:
    """``(height, width)`` every sampled frame is resized to: multiples of ``cfg.factor``."""
    return smart_resize(
        height,
        width,
        factor=cfg.factor,
        min_pixels=cfg.video_min_pixels,
        max_pixels=frame_pixel_cap(num_frames, cfg),
        item=item,
    )
