"""Test clips generated with PyAV: H.264 in MP4 (or another container) of a given size, frame rate
and duration, with a settable keyframe interval and B-frames, and variable-frame-rate clips.

Every frame carries its own index as a 16-bit barcode in a strip at the top (white block = 1,
black = 0, most significant bit on the left), so a test can read back *which* source frame a
decoded or resized frame is, without trusting the decoder under test:

    +--------+--------+-- ... --+--------+   <- strip: BARCODE_ROWS / height of the frame
    | bit 15 | bit 14 |         | bit 0  |
    +--------+--------+-- ... --+--------+
    |  smooth moving gradient (body)     |
    +------------------------------------+

The body is a smooth gradient that moves with the frame index, so resize parity is measured on
natural-looking content rather than on the barcode edges only.
"""

from __future__ import annotations

import io
import itertools
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np

BARCODE_BITS = 16
BARCODE_FRACTION = 0.125  # the strip is the top 1/8 of the frame


def frame_rgb(index: int, width: int, height: int) -> np.ndarray:
    """The RGB frame number ``index``: [height, width, 3] uint8."""
    ys = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]  # [H, 1]
    xs = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]  # [1, W]
    phase = index * 0.07
    r = 0.5 + 0.4 * np.sin(2.0 * np.pi * (xs + phase))
    g = 0.5 + 0.4 * np.cos(2.0 * np.pi * (ys * 0.7 + phase * 0.5))
    b = 0.5 + 0.4 * np.sin(2.0 * np.pi * (xs * 0.5 + ys * 0.5 - phase))
    img = np.stack(np.broadcast_arrays(r, g, b), axis=-1)  # [H, W, 3]
    out = (img * 255.0 + 0.5).astype(np.uint8)
    strip = max(8, int(height * BARCODE_FRACTION))
    for bit in range(BARCODE_BITS):
        x0 = bit * width // BARCODE_BITS
        x1 = (bit + 1) * width // BARCODE_BITS
        on = (index >> (BARCODE_BITS - 1 - bit)) & 1
        out[:strip, x0:x1] = 235 if on else 16
    return out


def read_barcode(frame: np.ndarray) -> int:
    """The frame index encoded by :func:`frame_rgb`, read from an RGB frame of any size."""
    height, width = frame.shape[:2]
    strip = max(8, int(height * BARCODE_FRACTION))
    row = frame[strip // 2].astype(np.float32).mean(axis=-1)  # [W]
    value = 0
    for bit in range(BARCODE_BITS):
        # sample the middle of the block: far from the edges the resize kernels disturb
        x = int((bit + 0.5) * width / BARCODE_BITS)
        value = (value << 1) | int(row[x] > 128.0)
    return value


def make_clip(
    width: int = 320,
    height: int = 240,
    fps: float = 10.0,
    seconds: float = 2.0,
    *,
    keyint: int | None = None,
    bframes: int = 0,
    container: str = "mp4",
    codec: str = "libx264",
    crf: int = 18,
    preset: str = "ultrafast",
    faststart: bool = False,
) -> bytes:
    """A constant-frame-rate clip of ``round(fps * seconds)`` barcoded frames, as container bytes.

    ``keyint`` fixes the GOP length (a keyframe every ``keyint`` frames, no scene-cut keyframes);
    ``bframes`` > 0 makes the decode order differ from the presentation order.
    """
    n = round(fps * seconds)
    rate = Fraction(fps).limit_denominator(1001)
    stream = _Stream(width, height, 1 / rate, rate, keyint, bframes, codec, crf, preset)
    return _encode([(i, i) for i in range(n)], stream, container=container, faststart=faststart)


def make_vfr_clip(
    timestamps_ms: Sequence[int],
    width: int = 320,
    height: int = 240,
    *,
    keyint: int | None = None,
    bframes: int = 0,
) -> bytes:
    """A variable-frame-rate MP4: frame ``i`` (barcode ``i``) is shown at ``timestamps_ms[i]``."""
    assert all(b > a for a, b in itertools.pairwise(timestamps_ms)), "timestamps must increase"
    stream = _Stream(width, height, Fraction(1, 1000), None, keyint, bframes)
    return _encode(list(enumerate(timestamps_ms)), stream, container="mp4", faststart=False)


@dataclass(frozen=True)
class _Stream:
    """How the video stream is encoded."""

    width: int
    height: int
    time_base: Fraction  # frame pts are in these units
    rate: Fraction | None  # the nominal frame rate; None for a variable-frame-rate clip
    keyint: int | None = None
    bframes: int = 0
    codec: str = "libx264"
    crf: int = 18
    preset: str = "ultrafast"


def _encode(frames: Sequence[tuple[int, int]], spec: _Stream, *, container: str, faststart: bool) -> bytes:
    """Encode ``(barcode index, pts in spec.time_base)`` pairs."""
    if faststart:
        # moving the index to the front rewrites the file: the muxer needs a real path
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"clip.{container}")
            with av.open(path, mode="w", format=container, options={"movflags": "+faststart"}) as out:
                _write_frames(out, frames, spec)
            with open(path, "rb") as f:
                return f.read()
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        _write_frames(out, frames, spec)
    return buf.getvalue()


def _write_frames(
    out: av.container.OutputContainer, frames: Sequence[tuple[int, int]], spec: _Stream
) -> None:
    codec, time_base = spec.codec, spec.time_base
    stream = out.add_stream(codec, rate=spec.rate) if spec.rate is not None else out.add_stream(codec)
    assert isinstance(stream, av.VideoStream), f"{codec} is not a video codec"
    stream.width = spec.width
    stream.height = spec.height
    stream.pix_fmt = "yuv420p"
    stream.time_base = time_base
    stream.codec_context.time_base = time_base
    if codec == "libx264":
        params = [f"bframes={spec.bframes}"]
        if spec.keyint is not None:
            params += [f"keyint={spec.keyint}", f"min-keyint={spec.keyint}", "scenecut=0"]
        stream.options = {"preset": spec.preset, "crf": str(spec.crf), "x264-params": ":".join(params)}
    for index, pts in frames:
        frame = av.VideoFrame.from_ndarray(frame_rgb(index, spec.width, spec.height), format="rgb24")
        frame.pts = pts
        frame.time_base = time_base
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode(None):
        out.mux(packet)
