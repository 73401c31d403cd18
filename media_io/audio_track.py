"""Where a video's sound track is cut: the rows of the track that MiMo-V2.5's processor lays out
beside the video's frames.

The processor encodes the whole track, then gives temporal patch ``i`` (starting at ``t_i``
seconds) the pads ``int(t_i * r)`` to ``int(t_(i+1) * r)``, and the last patch those up to
``min(int(end * r), total)``, with ``r`` pads per second and ``end`` the time after the last
sampled frame::

    sampled frames   t_0 ... t_(n-1)   (the video's own sampling rule, seconds = index / fps)
    sampled fps      1 / (t_1 - t_0)    (1.0 for a single frame)
    end              t_(n-1) + 1 / sampled fps

Sound past ``end`` is never laid out, so the rows kept are ``[int(t_0 * r), min(int(end * r),
total))``: with ``t_0`` = 0 (every rule samples the first frame) the first rows of the track, and
the prompt's per-patch counts (``llm_core.prompts.media_expansion.video_audio_pads``) add up to
them. This module reads the video stream's frame table only (no frame is decoded).

Nor is the sound past ``end`` decoded (``decode_until_s``): the audio tokenizer encodes each
``segment`` (60 s of mel frames) on its own and the tower's groups never straddle two, so the rows
of every segment that ends by ``end`` are those of the whole track's encode. The track is decoded
to the end of the segment holding ``end``, plus a second (the resampler's filter and the log-mel's
window reach a little past a cut; that second's rows are past ``end`` and never kept). A video
sampled over its first 13 minutes then decodes 13 minutes of sound, not its hour.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from media_io.config import MediaLimits, PreprocessConfig
from media_io.video_probe import scan_video
from media_io.video_sampling import sample_frame_indices


class TrackWindow(NamedTuple):
    """Seconds of the video that its sound track is laid out beside."""

    start_s: float  # the first sampled frame's time
    end_s: float  # the last sampled frame's time plus one sampled-frame spacing


def track_window(
    data: bytes, cfg: PreprocessConfig, limits: MediaLimits | None = None, item: str | None = None
) -> TrackWindow:
    """The window of the video in ``data``, sampled by ``cfg``'s rule (raises the probe's
    ``MediaError`` for a container without a usable video stream)."""
    info, _ = scan_video(data, item, limits)
    indices = sample_frame_indices(info.num_frames, info.fps, cfg)
    stamps = [float(i) / info.fps for i in indices]
    sampled_fps = 1.0 if len(stamps) < 2 else 1.0 / (stamps[1] - stamps[0])
    return TrackWindow(stamps[0], stamps[-1] + 1.0 / sampled_fps)


def decode_until_s(window: TrackWindow, segment_s: float, margin_s: float = 1.0) -> float:
    """How much of the track to decode for ``window``: to the end of the ``segment_s`` segment
    holding ``window.end_s``, plus ``margin_s`` (module docstring)."""
    return math.ceil(window.end_s / segment_s) * segment_s + margin_s


def track_rows(total: int, window: TrackWindow, tokens_per_second: float) -> slice:
    """The rows of a track of ``total`` rows laid out beside ``window`` (possibly empty: a track
    that ends before the first sampled frame)."""
    start = int(window.start_s * tokens_per_second)
    end = min(int(window.end_s * tokens_per_second), total)
    return slice(start, max(start, end))
