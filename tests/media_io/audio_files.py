"""Audio files written in memory with PyAV's encoders: tones of known frequency per channel."""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np

# container format, codec, what ``sniff`` calls the result
FORMATS: dict[str, tuple[str, str]] = {
    "wav": ("wav", "pcm_s16le"),
    "flac": ("flac", "flac"),
    "mp3": ("mp3", "libmp3lame"),
    "ogg": ("ogg", "libopus"),
    "m4a": ("ipod", "aac"),  # the iTunes muxer writes the "M4A " brand
    "aac": ("adts", "aac"),
}


def tone(seconds: float, rate: int, freqs: tuple[float, ...], amplitude: float = 0.5) -> np.ndarray:
    """[channels, n] float32 sines, one frequency per channel."""
    t = np.arange(round(seconds * rate)) / rate
    return np.stack([amplitude * np.sin(2 * np.pi * f * t) for f in freqs]).astype(np.float32)


def encode(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    """``samples`` [channels, n] float32 in ``fmt`` (a key of FORMATS)."""
    container, codec = FORMATS[fmt]
    channels = samples.shape[0]
    layout = {1: "mono", 2: "stereo"}[channels]
    if codec == "libopus":
        rate_out = 48000  # Opus runs at 48 kHz
    else:
        rate_out = rate
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=rate_out, layout=layout)
        assert isinstance(stream, av.AudioStream)
        resampler = av.AudioResampler(format=stream.format.name, layout=layout, rate=rate_out)
        step = 1024
        for start in range(0, samples.shape[1], step):
            chunk = np.ascontiguousarray(samples[:, start : start + step])
            frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=layout)
            frame.sample_rate = rate
            frame.pts = start
            frame.time_base = Fraction(1, rate)
            for f in resampler.resample(frame):
                for packet in stream.encode(f):
                    out.mux(packet)
        for f in resampler.resample(None):
            for packet in stream.encode(f):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()
