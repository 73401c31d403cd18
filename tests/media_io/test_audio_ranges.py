"""media_io.audio_ranges: a file decoded as output ranges (in this process or in the decode pool)
concatenates to exactly the sequential decode-resample, which is also what the worker's
``decode_audio`` gives."""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from media_io.audio import decode_audio
from media_io.audio_ranges import decode_ranges, decode_sequential, probe_track, split_ranges
from tests.media_io.audio_files import encode


def _speech(seconds: float, rate: int, channels: int, seed: int = 0) -> np.ndarray:
    """[channels, n] float32: a pitch changing every 200 ms under an envelope, plus noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * rate)) / rate
    syllable = np.floor(t / 0.2)
    voice = np.sin(2 * np.pi * (150 + 60 * np.sin(syllable)) * t) * np.sin(np.pi * (t / 0.2 - syllable)) ** 2
    return np.stack(
        [0.3 * voice * (1 - 0.2 * c) + rng.normal(0, 0.02, t.shape) for c in range(channels)]
    ).astype(np.float32)


def _aac_without_pns(samples: np.ndarray, rate: int) -> bytes:
    """M4A of ``samples`` [channels, n] with FFmpeg's AAC encoder, perceptual noise substitution
    off: a decoder fills PNS bands from a random state that runs from the start of the stream, so
    after a seek they hold other noise (``audio_ranges`` docstring)."""
    layout = {1: "mono", 2: "stereo"}[samples.shape[0]]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="ipod") as out:
        stream = out.add_stream("aac", rate=rate, layout=layout)
        stream.options = {"aac_pns": "0"}
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout=layout)
        frame.sample_rate, frame.pts, frame.time_base = rate, 0, Fraction(1, rate)
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("fmt", "rate", "channels"),
    [("m4a", 44100, 2), ("m4a", 48000, 1), ("mp3", 44100, 2), ("flac", 22050, 2)],
)
def test_ranges_equal_the_sequential_decode(tmp_path: Path, fmt: str, rate: int, channels: int) -> None:
    path = tmp_path / f"clip.{fmt}"
    samples = _speech(9.3, rate, channels)
    path.write_bytes(_aac_without_pns(samples, rate) if fmt == "m4a" else encode(samples, rate, fmt))
    want = decode_sequential(path, 24000)
    assert np.array_equal(want, decode_audio(path.read_bytes()).samples)  # the worker's decoder
    track = probe_track(path)
    ranges = split_ranges(track.duration_s, 24000, 48000)  # 2 s ranges, the last open-ended
    assert len(ranges) == 5 and ranges[-1].stop is None
    parts = list(decode_ranges(path, 24000, ranges))
    assert [len(p) for p in parts[:-1]] == [48000] * 4
    assert np.array_equal(np.concatenate(parts), want)  # exact, seams included


def test_ranges_in_the_pool(tmp_path: Path) -> None:
    path = tmp_path / "clip.m4a"
    path.write_bytes(_aac_without_pns(_speech(7.0, 44100, 2, seed=3), 44100))
    want = decode_sequential(path, 24000)
    ranges = split_ranges(probe_track(path).duration_s, 24000, 30000)
    got = np.concatenate(list(decode_ranges(path, 24000, ranges, workers=2)))
    assert np.array_equal(got, want)
