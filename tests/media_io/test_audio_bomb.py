"""Audio that costs more than it declares (media_io/audio.py, media_io/work_estimate.py): a few KB
of WAV at 1 Hz "lasting" an hour, or with 64 channels, is refused from its header before any
sample is decoded, with the peak memory and CPU it cost measured; an honest hour is counted as an
hour at admission, before the work."""

from __future__ import annotations

import io
import subprocess
import sys
import wave

import pytest

from media_io.audio import decode_audio, probe_audio
from media_io.config import MediaLimits
from media_io.errors import BadMedia, MediaTooLarge
from media_io.work_estimate import AUDIO_FRAMES_PER_S, audio_seconds
from tests.media_io.audio_files import encode, tone


def wav(rate: int, seconds: float, channels: int = 1) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(1)
        w.setframerate(rate)
        w.writeframes(bytes(int(rate * seconds) * channels))
    return buf.getvalue()


def test_a_1hz_hour_is_refused_from_its_header() -> None:
    bomb = wav(1, 3600.0)
    assert len(bomb) < 4096  # 3,600 one-byte samples and a header
    with pytest.raises(BadMedia, match="sample rate 1 Hz"):
        decode_audio(bomb)
    with pytest.raises(BadMedia, match="sample rate"):
        probe_audio(bomb)


def test_too_many_channels_are_refused_from_the_header() -> None:
    with pytest.raises(MediaTooLarge, match="64 channels"):
        decode_audio(wav(8000, 0.1, channels=64))


def test_a_declared_length_over_the_cap_is_refused_before_decoding() -> None:
    clip = encode(tone(3.0, 16000, (440.0,)), 16000, "wav")
    with pytest.raises(MediaTooLarge, match=r"3\.0 s long"):
        decode_audio(clip, limits=MediaLimits(max_audio_seconds=2.0))


def test_admission_counts_the_declared_length() -> None:
    clip = encode(tone(2.5, 16000, (440.0,)), 16000, "wav")
    assert audio_seconds(clip) == pytest.approx(2.5, abs=0.01)
    assert audio_seconds(b"not audio") == 0.0
    from media_io.config import PreprocessConfig
    from media_io.work_estimate import PatchEstimator

    est = PatchEstimator(PreprocessConfig())
    assert est.estimate(clip, "audio") == pytest.approx(2.5 * AUDIO_FRAMES_PER_S, abs=2)
    assert est.estimate(wav(1, 3600.0), "audio") == 1000.0  # unreadable as audio here: the seed


_MEASURE = r"""
import resource, sys, time, io, wave
from media_io.audio import decode_audio
from media_io.errors import MediaError
buf = io.BytesIO()
with wave.open(buf, "wb") as w:
    w.setnchannels(1); w.setsampwidth(1); w.setframerate(1); w.writeframes(bytes(3600))
bomb = buf.getvalue()
before = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.process_time()
try:
    decode_audio(bomb)
except MediaError as e:
    print(type(e).__name__)
cpu = time.process_time() - t0
after = resource.getrusage(resource.RUSAGE_SELF)
print(cpu, after.ru_maxrss - before.ru_maxrss)
"""


def test_the_bomb_costs_next_to_nothing_before_refusal() -> None:
    """Measured in a process of its own: the CPU spent decoding the 1 Hz hour until refusal, and
    what it added to the peak resident memory (docs/limits.md quotes these)."""
    done = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    kind, figures = done.stdout.split("\n")[:2]
    cpu_s, rss_kb = float(figures.split()[0]), int(figures.split()[1])
    assert kind == "BadMedia"
    print(f"audio bomb refused: {cpu_s * 1e3:.2f} ms CPU, peak RSS +{rss_kb} KB")
    assert cpu_s < 0.05 and rss_kb < 8 * 1024  # it resampled to 230 MB of samples before
