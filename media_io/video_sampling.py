"""Which frames of a video the model looks at, at what size, and what time each temporal pair shows.

A rule per processor family; ``PreprocessConfig.video_sampling`` names the one a checkpoint's
processor files chose (``media_io.processor_config``), and the functions at the bottom dispatch
on it, so the decode path never asks which model it serves. Both rules keep the count a multiple
of ``temporal_patch_size`` (an even count) and give one timestamp per temporal pair.

``qwen2_vl``: transformers' ``Qwen2VLVideoProcessor`` (``sample_frames`` and ``resize``), so the
frames we decode are the frames the reference would have picked:

- count: ``total / video_fps * fps`` (2 fps), clamped to ``[min_frames, max_frames]`` and to the
  frames that exist, then floored to a multiple of ``temporal_patch_size``;
- indices: ``arange(0, total, total / count).int()``, i.e. evenly spaced by index. The decoder
  maps each index to that frame's presentation timestamp (see ``FrameTable``), so a variable
  frame rate clip still yields exactly the frames the reference would have indexed;
- size: ``smart_resize`` with ``video_min_pixels`` and a per-frame cap that is the smaller of
  ``video_max_pixels`` and an even share of ``video_total_pixels`` per temporal patch (floored at
  1.05 x ``video_min_pixels``): transformers' ``cap_pixels_per_frame=True`` rule, which bounds the
  total cost of long videos the way qwen-vl-utils does.

``mimo_v2``: MiMo-V2.5's processor (sglang's ``MiMoProcessor`` with qwen-vl-utils'
``smart_nframes``, the public reference of the encoder side; the checkpoint's
``processor_config`` holds its numbers: 1 fps, at most 3600 frames):

- count: ``total / video_fps * fps``, clamped to ``[ceil_even(min_frames), floor_even(max_frames)]``
  and to the frames that exist, then floored to a multiple of ``temporal_patch_size``;
- indices: ``unique(floor(linspace(0, total - 1, count)))`` (numpy's integer ``linspace``, as the
  reference calls it), so the first and the last frame are always sampled;
- size: ``smart_resize`` with ``video_min_pixels`` and the per-frame cap
  ``max(video_min_pixels, min(video_max_pixels, video_total_pixels * temporal_patch_size //
  num_frames))``, ``num_frames`` being the sampled count before padding;
- a pair's timestamp is its first frame's ``index / avg_fps`` seconds (the reference formats it
  as ``MM:SS`` text in the prompt).

A video shorter than one temporal patch, which both references reject, yields all its frames
(patchify then pads by repeating the last one).

This module knows nothing of containers or decoding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from media_io.config import PreprocessConfig, VideoSamplingRule
from media_io.preprocess.resize import smart_resize


class SamplingRule(Protocol):
    """One processor family's video sampling (see the module docstring)."""

    def num_frames(self, total_frames: int, video_fps: float, cfg: PreprocessConfig) -> int:
        """Frames sampled from ``total_frames`` at ``video_fps``; 0 when fewer than one temporal
        patch exist (then every frame is taken)."""
        ...

    def indices(self, total_frames: int, count: int, cfg: PreprocessConfig) -> list[int]:
        """Ascending, distinct display-order indices of ``count`` (> 0) sampled frames."""
        ...

    def frame_pixel_cap(self, num_frames: int, cfg: PreprocessConfig) -> int:
        """The per-frame ``max_pixels`` for ``num_frames`` sampled frames."""
        ...

    def pair_timestamps(
        self, indices: Sequence[int], video_fps: float, cfg: PreprocessConfig
    ) -> tuple[float, ...]:
        """Seconds of each temporal pair (``ceil(len(indices) / temporal_patch_size)`` values)."""
        ...


class Qwen2VLSampling:
    """transformers' ``Qwen2VLVideoProcessor``: 2 fps, ``arange`` indices, capped at 1.05 x min."""

    def num_frames(self, total_frames: int, video_fps: float, cfg: PreprocessConfig) -> int:
        tps = cfg.temporal_patch_size
        max_frames = math.floor(min(cfg.max_frames, total_frames) / tps) * tps
        count = total_frames / video_fps * cfg.fps
        count = min(max(count, cfg.min_frames), max_frames, total_frames)
        return math.floor(count / tps) * tps

    def indices(self, total_frames: int, count: int, cfg: PreprocessConfig) -> list[int]:
        # The reference's float arange, computed with torch exactly as it does. It can run one
        # step long: an extra index below ``total_frames`` is kept (the count is then odd and
        # patchify pads, as the reference does); one at ``total_frames`` or beyond names no frame
        # and is dropped, as the reference's own PyAV loader drops it.
        found = torch.arange(0, total_frames, total_frames / count).int()
        return [int(i) for i in found.tolist() if i < total_frames]

    def frame_pixel_cap(self, num_frames: int, cfg: PreprocessConfig) -> int:
        share = cfg.video_total_pixels * cfg.temporal_patch_size // num_frames
        return max(min(cfg.video_max_pixels, share), int(cfg.video_min_pixels * 1.05))

    def pair_timestamps(
        self, indices: Sequence[int], video_fps: float, cfg: PreprocessConfig
    ) -> tuple[float, ...]:
        return _first_of_each_pair(indices, video_fps, cfg)


class MiMoV2Sampling:
    """MiMo-V2.5's processor: ``fps`` (1.0) up to ``max_frames`` (3600), ``linspace`` indices."""

    def num_frames(self, total_frames: int, video_fps: float, cfg: PreprocessConfig) -> int:
        tps = cfg.temporal_patch_size
        min_frames = math.ceil(cfg.min_frames / tps) * tps
        max_frames = math.floor(cfg.max_frames / tps) * tps
        count = total_frames / video_fps * cfg.fps
        count = min(max(count, min_frames), max_frames, total_frames)
        return math.floor(count / tps) * tps

    def indices(self, total_frames: int, count: int, cfg: PreprocessConfig) -> list[int]:
        # numpy's integer linspace floors (towards -inf) the float positions; unique() is a no-op
        # while count <= total (steps of at least one frame) but is part of the rule.
        found = np.unique(np.linspace(0, total_frames - 1, num=count, dtype=np.int64))
        return [int(i) for i in found.tolist()]

    def frame_pixel_cap(self, num_frames: int, cfg: PreprocessConfig) -> int:
        share = cfg.video_total_pixels * cfg.temporal_patch_size // num_frames
        return max(cfg.video_min_pixels, min(share, cfg.video_max_pixels))

    def pair_timestamps(
        self, indices: Sequence[int], video_fps: float, cfg: PreprocessConfig
    ) -> tuple[float, ...]:
        return _first_of_each_pair(indices, video_fps, cfg)


def _first_of_each_pair(indices: Sequence[int], video_fps: float, cfg: PreprocessConfig) -> tuple[float, ...]:
    """``index / video_fps`` of the first frame of each temporal pair. A padded last pair starts
    with a real frame, so its time is that frame's (the padding repeats the last frame and time)."""
    assert video_fps > 0, video_fps
    return tuple(float(i) / video_fps for i in indices[:: cfg.temporal_patch_size])


RULES: dict[VideoSamplingRule, SamplingRule] = {
    "qwen2_vl": Qwen2VLSampling(),
    "mimo_v2": MiMoV2Sampling(),
}


def sampling_rule(cfg: PreprocessConfig) -> SamplingRule:
    """The rule ``cfg.video_sampling`` names."""
    return RULES[cfg.video_sampling]


def num_sampled_frames(
    total_frames: int, video_fps: float, cfg: PreprocessConfig = PreprocessConfig()
) -> int:
    """How many frames ``cfg``'s rule takes from a video of ``total_frames`` at ``video_fps``.

    Zero when the video has fewer frames than one temporal patch (the references cannot sample
    those; :func:`sample_frame_indices` then takes every frame).
    """
    assert total_frames >= 0 and video_fps > 0, (total_frames, video_fps)
    return sampling_rule(cfg).num_frames(total_frames, video_fps, cfg)


def sample_frame_indices(
    total_frames: int, video_fps: float, cfg: PreprocessConfig = PreprocessConfig()
) -> list[int]:
    """Indices (display order, strictly ascending) of the frames ``cfg``'s rule samples.

    For ``qwen2_vl`` identical to ``Qwen2VLVideoProcessor.sample_frames(metadata, fps=cfg.fps)``
    (less an index past the end, see ``Qwen2VLSampling.indices``).
    """
    count = num_sampled_frames(total_frames, video_fps, cfg)
    if count == 0:
        return list(range(total_frames))
    return sampling_rule(cfg).indices(total_frames, count, cfg)


def frame_pixel_cap(num_frames: int, cfg: PreprocessConfig = PreprocessConfig()) -> int:
    """The per-frame ``max_pixels`` for a video of ``num_frames`` sampled frames."""
    assert num_frames > 0, num_frames
    return sampling_rule(cfg).frame_pixel_cap(num_frames, cfg)


def pair_timestamps(
    indices: Sequence[int], video_fps: float, cfg: PreprocessConfig = PreprocessConfig()
) -> tuple[float, ...]:
    """Seconds of each temporal pair of the sampled ``indices`` (one per grid t)."""
    return sampling_rule(cfg).pair_timestamps(indices, video_fps, cfg)


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
