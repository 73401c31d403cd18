"""Video bytes -> the frames the model samples, RGB at the smart_resize target size.

    bytes ──probe──▶ VideoInfo + FrameTable      header caps checked first (413), then packets indexed
          ──sample─▶ indices, size, pair times   the rule cfg.video_sampling names (Qwen2-VL's 2 fps,
                                                 MiMo-V2.5's 1 fps linspace; media_io.video_sampling)
          ──plan───▶ keyframe runs ─▶ segments    only the GOPs that hold sampled frames
          ──decode─▶ [T, H, W, 3] uint8           in-process, or pooled workers via shared memory

The pieces live in ``video_probe`` (container facts), ``video_sampling`` (which frames, what
size), ``video_plan`` (which GOPs, split how) and ``video_decode`` (decoders, workers, shared
memory). This module only wires them and
turns their failures into ``MediaError`` for the item.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import NamedTuple

import numpy as np

from media_io.config import MediaLimits, PreprocessConfig
from media_io.errors import BadMedia, MediaTooLarge
from media_io.video_decode import (
    POOL_MIN_WORK,
    ResizeMode,
    SegmentDecodeError,
    decode_in_pool,
    decode_segment,
    warm_pool,
)
from media_io.video_plan import Run, plan_runs, split_segments
from media_io.video_probe import VideoInfo, probe_video, scan_video
from media_io.video_sampling import pair_timestamps, sample_frame_indices, target_size

__all__ = ["VideoFrames", "VideoInfo", "decode_video", "probe_video", "sample_frame_indices"]

# Tasks per worker: more, smaller segments even out GOPs of unequal cost.
SEGMENTS_PER_WORKER = 2


class VideoFrames(NamedTuple):
    """The sampled frames of one video."""

    frames: np.ndarray  # [T, H, W, 3] uint8 RGB at the smart_resize target size
    indices: list[int]  # display-order index of each frame in the source
    timestamps: list[float]  # presentation time, seconds from the first frame, one per frame
    info: VideoInfo
    # One per temporal pair (grid t = ceil(T / temporal_patch_size)): the seconds the sampling
    # rule gives the pair, its first frame's index / average fps (MiMo-V2.5 writes them into the
    # prompt as MM:SS). For a constant frame rate clip they match ``timestamps[::2]`` up to rounding.
    pair_timestamps: tuple[float, ...]


def decode_video(
    data: bytes,
    cfg: PreprocessConfig = PreprocessConfig(),
    limits: MediaLimits = MediaLimits(),
    item: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    workers: int | None = None,
    resize: ResizeMode = "exact",
) -> VideoFrames:
    """Probe, sample by ``cfg``'s rule (``cfg.video_sampling``) and decode the sampled frames of ``data``.

    ``workers``: None picks the CPU count and decodes in-process when the work is too small for
    the pool to pay off; 1 always decodes in-process; >= 2 always uses a pool of that many.
    ``progress(done, total)`` is called as frames land (per frame in-process, per segment from
    the pool), from the calling thread.

    Raises:
        BadMedia: no video stream, corrupt or truncated data (the message names ``item``).
        MediaTooLarge: over a duration, frame-count or pixel cap of ``limits``.
    """
    info, table = scan_video(data, item, limits)
    indices = sample_frame_indices(info.num_frames, info.fps, cfg)
    if len(indices) > limits.max_video_frames:
        raise MediaTooLarge(
            f"video would sample {len(indices)} frames, above the {limits.max_video_frames}-frame limit", item
        )
    height, width = target_size(info.height, info.width, len(indices), cfg, item)
    shape = (len(indices), height, width, 3)
    runs = plan_runs(table, indices)
    n_workers = workers if workers is not None else _usable_cpus()
    work = sum(r.cost for r in runs) * info.width * info.height
    pooled = n_workers >= 2 and len(runs) >= 2 and (workers is not None or work >= POOL_MIN_WORK)
    try:
        if pooled:
            segments = split_segments(runs, n_workers * SEGMENTS_PER_WORKER)
            frames = decode_in_pool(data, segments, shape, n_workers, resize, progress)
        else:
            frames = _decode_here(data, runs, shape, resize, progress)
    except SegmentDecodeError as e:
        raise BadMedia(f"cannot decode video: {e}", item) from e
    except BrokenProcessPool as e:
        raise BadMedia("a video decoder process died on this input", item) from e
    start = table.pts[0]
    timestamps = [table.seconds(int(table.pts[i] - start)) for i in indices]
    return VideoFrames(
        frames=frames,
        indices=indices,
        timestamps=timestamps,
        info=info,
        pair_timestamps=pair_timestamps(indices, info.fps, cfg),
    )


def _decode_here(
    data: bytes,
    runs: list[Run],
    shape: tuple[int, int, int, int],
    resize: ResizeMode,
    progress: Callable[[int, int], None] | None,
) -> np.ndarray:
    out = np.empty(shape, dtype=np.uint8)  # [T, H, W, 3]
    done = 0

    def on_frame() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, shape[0])

    for segment in split_segments(runs, 1):
        decode_segment(data, segment, out, resize, threads=0, on_frame=on_frame)
    return out


def warm_decode_pool(workers: int | None) -> int:
    """Start the decode pool ``decode_video(..., workers=workers)`` would use, so that the first
    long video does not pay for starting its processes (seconds each: they import torch). Returns
    how many processes were started (0 when that setting decodes in-process)."""
    n_workers = workers if workers is not None else _usable_cpus()
    return len(warm_pool(n_workers)) if n_workers >= 2 else 0


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
