"""A corpus of bad videos, generated with PyAV: each is something a client may really send.

- ``audio_only_mp4``: a valid MP4 with one AAC stream and no video stream;
- ``truncated_mp4``: a clip cut short; with the index (moov) at the end the container cannot be
  opened at all, with it at the front (faststart) the header promises frames that are missing;
- ``huge_duration_mp4``: three tiny frames whose timestamps span hours, so the header declares a
  duration far above any cap while the file is a few kilobytes;
- ``corrupt_header``: container bytes overwritten at the start (no recognisable format);
- ``corrupt_payload``: a valid header whose frame data is overwritten with noise (decoders may
  conceal this: the pipeline must either fail cleanly or return frames of the right shape).
"""

from __future__ import annotations

import io

import av
import numpy as np

from tests.fixtures.video_factory import make_clip, make_vfr_clip


def audio_only_mp4(seconds: float = 0.5, rate: int = 16000) -> bytes:
    """An MP4 holding a single AAC audio stream (a sine tone)."""
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("aac", rate=rate)
        stream.layout = "mono"
        n = int(seconds * rate)
        t = np.arange(n, dtype=np.float32) / rate
        tone = (0.2 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)[None, :]  # [1, n] planar
        frame_size = 1024
        for i, start in enumerate(range(0, n, frame_size)):
            chunk = np.ascontiguousarray(tone[:, start : start + frame_size])
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout="mono")
            frame.sample_rate = rate
            frame.pts = i * frame_size
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def truncated_mp4(keep: float = 0.5, faststart: bool = False) -> bytes:
    """The first ``keep`` fraction of a 2 s clip's bytes."""
    data = make_clip(seconds=2.0, keyint=5, faststart=faststart)
    return data[: int(len(data) * keep)]


def huge_duration_mp4(hours: float = 2.0) -> bytes:
    """Three 64x64 frames at 0 s, ``hours / 2`` and ``hours``: a tiny file declaring a long video."""
    last_ms = int(hours * 3600 * 1000)
    return make_vfr_clip([0, last_ms // 2, last_ms], 64, 64)


def corrupt_header(seed: int = 0) -> bytes:
    """A valid clip whose first 256 bytes are replaced by noise."""
    data = bytearray(make_clip(seconds=1.0))
    data[:256] = np.random.default_rng(seed).integers(0, 256, 256, dtype=np.uint8).tobytes()
    return bytes(data)


def corrupt_payload(seed: int = 0) -> bytes:
    """A faststart clip (index first) whose second half, the frame data, is replaced by noise."""
    data = bytearray(make_clip(seconds=2.0, keyint=5, faststart=True))
    half = len(data) // 2
    data[half:] = np.random.default_rng(seed).integers(0, 256, len(data) - half, dtype=np.uint8).tobytes()
    return bytes(data)
