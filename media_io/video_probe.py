"""Video probe: what a video is, from its container header and packet index, without decoding.

``scan_video`` opens the bytes with PyAV, checks the header against ``MediaLimits`` (duration,
pixels per frame, declared frame count) *before* touching the packets, then demuxes the video
stream's packets (cheap: no decoding) to build a ``FrameTable``: every frame's presentation
timestamp in display order and the keyframes'. The table is what makes sampling by index work for
variable frame rate clips and what splits the decode into keyframe-aligned segments.

This module knows nothing of sampling rates, target sizes or pixels.
"""

from __future__ import annotations

from fractions import Fraction
from typing import NamedTuple

import av
import av.error
import numpy as np

from media_io.av_container import declared_seconds, error_reason, open_container, require_stream
from media_io.config import MediaLimits
from media_io.errors import BadMedia, MediaTooLarge

# A source frame rate above this is treated as hostile: with the duration cap it bounds how many
# packets the probe will index (the sampled frames are capped separately by max_video_frames).
MAX_SOURCE_FPS = 240.0


class VideoInfo(NamedTuple):
    """What the container says about its first video stream."""

    codec: str
    width: int
    height: int
    fps: float  # average frame rate (what transformers' PyAV loader uses for sampling)
    duration_s: float
    num_frames: int  # frames that exist (indexed packets), in display order
    has_video: bool
    keyframe_times: tuple[float, ...]  # seconds, ascending


class FrameTable(NamedTuple):
    """Presentation timestamps of the video stream, in its ``time_base``.

    Invariants: ``pts`` is strictly increasing (display order); ``keyframe_pts`` is a sorted
    subset of ``pts`` whose first element is ``pts[0]`` (decoding can always start there).
    """

    pts: np.ndarray  # [num_frames] int64
    keyframe_pts: np.ndarray  # [num_keyframes] int64
    time_base: Fraction

    def seconds(self, pts: int) -> float:
        """A timestamp of this table in seconds."""
        return float(pts * self.time_base)


class Probe(NamedTuple):
    """``VideoInfo`` plus the frame table the decoder plans from."""

    info: VideoInfo
    table: FrameTable


def probe_video(data: bytes, item: str | None = None, limits: MediaLimits | None = None) -> VideoInfo:
    """Codec, size, frame rate, duration, frame count and keyframe times of ``data``.

    Raises:
        BadMedia: empty, corrupt or truncated bytes, or no video stream (audio only).
        MediaTooLarge: over a cap of ``limits`` (checked before any packet is read).
    """
    return scan_video(data, item, limits or MediaLimits()).info


def scan_video(data: bytes, item: str | None = None, limits: MediaLimits | None = None) -> Probe:
    """``probe_video`` plus the ``FrameTable`` (see the module docstring)."""
    limits = limits or MediaLimits()
    container = open_container(data, "video", limits, item)
    with container:
        require_stream(container, "video", item)
        stream = container.streams.video[0]
        width, height = int(stream.codec_context.width), int(stream.codec_context.height)
        if width <= 0 or height <= 0:
            raise BadMedia(f"video stream has no frame size ({width}x{height})", item)
        time_base = stream.time_base if stream.time_base is not None else Fraction(1, 1_000_000)
        declared_s = declared_seconds(container, stream)
        _check_header(width, height, declared_s, int(stream.frames), limits, item)

        table = _index_packets(container, stream, time_base, limits, item)
        declared_frames = int(stream.frames)
        if declared_frames > 0 and len(table.pts) < declared_frames:
            raise BadMedia(
                f"video is truncated: the header declares {declared_frames} frames, "
                f"only {len(table.pts)} are present",
                item,
            )
        rate = stream.average_rate
        span_s = table.seconds(int(table.pts[-1] - table.pts[0]))
        if rate is not None and rate > 0:
            fps = float(rate)
        elif span_s > 0:
            fps = (len(table.pts) - 1) / span_s
        else:
            fps = 1.0
        duration_s = declared_s if declared_s > 0 else len(table.pts) / fps
        info = VideoInfo(
            codec=stream.codec_context.name,
            width=width,
            height=height,
            fps=fps,
            duration_s=duration_s,
            num_frames=len(table.pts),
            has_video=True,
            keyframe_times=tuple(table.seconds(int(p)) for p in table.keyframe_pts),
        )
        return Probe(info, table)


def _check_header(
    width: int, height: int, duration_s: float, declared_frames: int, limits: MediaLimits, item: str | None
) -> None:
    if width * height > limits.max_video_pixels_per_frame:
        raise MediaTooLarge(
            f"video frames are {width}x{height} = {width * height} pixels, above the "
            f"{limits.max_video_pixels_per_frame}-pixel limit",
            item,
        )
    if duration_s > limits.max_video_seconds:
        raise MediaTooLarge(
            f"video lasts {duration_s:.1f} s, above the {limits.max_video_seconds:.0f} s limit", item
        )
    max_source = int(limits.max_video_seconds * MAX_SOURCE_FPS)
    if declared_frames > max_source:
        raise MediaTooLarge(
            f"video declares {declared_frames} frames, above the {max_source}-frame limit "
            f"({limits.max_video_seconds:.0f} s at {MAX_SOURCE_FPS:.0f} fps)",
            item,
        )


def _index_packets(
    container: av.container.InputContainer,
    stream: av.video.stream.VideoStream,
    time_base: Fraction,
    limits: MediaLimits,
    item: str | None,
) -> FrameTable:
    """Demux (never decode) every packet of ``stream``: their pts in display order, and keyframes."""
    max_source = int(limits.max_video_seconds * MAX_SOURCE_FPS)
    pts: list[int] = []
    keys: list[int] = []
    try:
        for packet in container.demux(stream):
            stamp = packet.pts if packet.pts is not None else packet.dts
            if stamp is None or packet.size == 0:
                continue  # the flush packet, or a packet with no timing: not a frame we can place
            pts.append(int(stamp))
            if packet.is_keyframe:
                keys.append(int(stamp))
            if len(pts) > max_source:
                raise MediaTooLarge(f"video has more than {max_source} frames", item)
    except av.error.FFmpegError as e:
        raise BadMedia(f"corrupt video packets: {error_reason(e)}", item) from e
    if not pts:
        raise BadMedia("video stream has no frames", item)
    order = np.unique(np.asarray(pts, dtype=np.int64))  # sorted, display order
    if len(order) != len(pts):
        raise BadMedia(f"video has {len(pts) - len(order)} frames with duplicate timestamps", item)
    key_arr = np.unique(np.asarray(keys, dtype=np.int64))
    if len(key_arr) == 0 or key_arr[0] != order[0]:
        # Decoding must start at a keyframe; a stream whose first shown frame is not one (an
        # open-GOP cut) still decodes from its start, so treat the start as the first segment.
        key_arr = np.concatenate([order[:1], key_arr[key_arr > order[0]]])
    return FrameTable(pts=order, keyframe_pts=key_arr, time_base=time_base)
