"""Audio decode: every supported container to 24 kHz mono float32, and what must be refused."""

from __future__ import annotations

import struct

import av
import numpy as np
import pytest

from media_io.audio import decode_audio
from media_io.audio_config import AudioConfig
from media_io.config import MediaLimits
from media_io.errors import BadMedia, MediaTooLarge, UnsupportedMedia
from media_io.sniff import MediaKind, sniff
from tests.media_io.audio_files import FORMATS, encode, tone
from tests.media_io.test_sniff import _encode_video


def _peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(spectrum.argmax() * rate / len(samples))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format_decodes_to_mono_at_the_model_rate(fmt: str) -> None:
    if FORMATS[fmt][1] not in av.codecs_available:
        pytest.skip(f"{FORMATS[fmt][1]} is not built into this PyAV")
    data = encode(tone(1.0, 44100, (440.0, 440.0)), 44100, fmt)
    assert sniff(data) == MediaKind("audio", fmt)
    clip = decode_audio(data, AudioConfig(), item="a")
    assert clip.sample_rate == 24000 and clip.samples.dtype == np.float32 and clip.samples.ndim == 1
    # lossy codecs add their priming/padding samples (tens of ms), never a different length
    assert abs(clip.seconds - 1.0) < 0.06, clip.seconds
    assert abs(_peak_hz(clip.samples, 24000) - 440.0) < 2.0
    assert clip.source.channels == 2


def test_channels_are_averaged() -> None:
    # left 300 Hz, right 1000 Hz: the mono clip holds both at half amplitude
    data = encode(tone(1.0, 24000, (300.0, 1000.0), amplitude=0.8), 24000, "wav")
    samples = decode_audio(data).samples
    expected = tone(1.0, 24000, (300.0, 1000.0), amplitude=0.8).mean(axis=0)
    # 16-bit PCM: one quantisation step of each channel, halved
    np.testing.assert_allclose(samples, expected, atol=2.0 / 32768)


def test_the_rate_comes_from_the_config() -> None:
    data = encode(tone(0.5, 44100, (1000.0,)), 44100, "flac")
    clip = decode_audio(data, AudioConfig(sample_rate=16000, n_fft=400, window_size=400, hop_length=160))
    assert clip.sample_rate == 16000 and len(clip.samples) == 8000
    assert abs(_peak_hz(clip.samples, 16000) - 1000.0) < 3.0


def test_too_long_by_its_header_is_refused_before_decoding() -> None:
    data = encode(tone(3.0, 8000, (440.0,)), 8000, "wav")
    with pytest.raises(MediaTooLarge, match=r"3\.0 s long, above the 2-second limit") as err:
        decode_audio(data, limits=MediaLimits(max_audio_seconds=2.0), item="long.wav")
    assert err.value.status == 413 and err.value.item == "long.wav"


def test_too_long_without_a_declared_duration_is_caught_while_decoding() -> None:
    data = encode(tone(4.0, 8000, (440.0,)), 8000, "aac")  # ADTS: no duration in any header
    with pytest.raises(MediaTooLarge, match="above the 2-second limit"):
        decode_audio(data, limits=MediaLimits(max_audio_seconds=2.0))


def test_over_the_byte_cap() -> None:
    data = encode(tone(1.0, 8000, (440.0,)), 8000, "wav")
    with pytest.raises(MediaTooLarge, match="bytes"):
        decode_audio(data, limits=MediaLimits(max_bytes=1000))


def test_empty_and_corrupt_and_truncated() -> None:
    with pytest.raises(BadMedia, match="empty"):
        decode_audio(b"", item="e")
    good = encode(tone(1.0, 8000, (440.0,)), 8000, "flac")
    with pytest.raises(BadMedia) as err:
        decode_audio(good[:4] + bytes(2000), item="c.flac")
    assert err.value.item == "c.flac" and err.value.status == 400


def test_a_header_with_no_samples_is_bad_media() -> None:
    data = encode(tone(1.0, 8000, (440.0,)), 8000, "wav")
    with pytest.raises(BadMedia) as err:
        decode_audio(data[:44], item="h.wav")  # the RIFF header alone
    assert err.value.item == "h.wav"
    # a well-formed WAV whose data chunk is empty: mono 16-bit PCM at 8 kHz, 0 samples
    fmt_chunk = b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, 8000, 16000, 2, 16)
    silent = b"RIFF" + struct.pack("<I", 4 + len(fmt_chunk) + 8) + b"WAVE" + fmt_chunk + b"data" + bytes(4)
    with pytest.raises(BadMedia, match="no samples"):
        decode_audio(silent, item="z.wav")


def test_no_audio_stream_names_what_is_there() -> None:
    with pytest.raises(BadMedia, match=r"no audio stream \(streams: video\)"):
        decode_audio(_encode_video("mp4", "mpeg4"), item="v.mp4")


def unknown_codec_wav() -> bytes:
    """A well-formed WAV whose format tag (0x7777) names no codec."""
    fmt_chunk = b"fmt " + struct.pack("<IHHIIHH", 16, 0x7777, 1, 8000, 16000, 2, 16)
    data = bytes(1600)
    size = 4 + len(fmt_chunk) + 8 + len(data)
    return (
        b"RIFF"
        + struct.pack("<I", size)
        + b"WAVE"
        + fmt_chunk
        + b"data"
        + struct.pack("<I", len(data))
        + data
    )


def test_an_unknown_codec_is_unsupported_media() -> None:
    with pytest.raises(UnsupportedMedia, match="codec") as err:
        decode_audio(unknown_codec_wav(), item="u.wav")
    assert err.value.status == 415 and err.value.item == "u.wav"
