"""Audio decode: any container PyAV reads, to float32 mono samples at the model's rate.

    bytes ──open──▶ first audio stream ──decode──▶ frames ──resample (libswresample)──▶
          [C, n] float32 at ``AudioConfig.sample_rate`` ──mean over channels──▶ [N] float32 mono

What the stream costs is checked before any packet is decoded (``probe_audio``): its sample rate
and channel count within ``MediaLimits``' bounds (a 1 Hz stream declaring an hour is a few KB that
would resample to gigabytes) and its declared duration under ``max_audio_seconds``. Then the
duration is counted again while decoding, on the input before each frame is resampled and on the
samples produced, so a header that lies (or has no duration) cannot make the decoder run on. Channels are averaged after resampling, the downmix the
reference processors apply to a loaded waveform (``wav.mean(0)``), rather than libswresample's
own matrix, whose coefficients depend on the layout.
"""

from __future__ import annotations

import io
from typing import NamedTuple

import av
import av.error
import numpy as np

from media_io.audio_config import AudioConfig
from media_io.av_container import declared_seconds, error_reason, open_container, require_stream
from media_io.config import MediaLimits
from media_io.errors import BadMedia, MediaTooLarge, UnsupportedMedia


class AudioSource(NamedTuple):
    """What the container says about the stream that was decoded."""

    codec: str
    sample_rate: int
    channels: int
    declared_s: float  # 0.0 when the header declares no duration


class AudioClip(NamedTuple):
    samples: np.ndarray  # [N] float32, mono, at ``sample_rate``
    sample_rate: int
    source: AudioSource

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sample_rate


def decode_audio(
    data: bytes,
    cfg: AudioConfig = AudioConfig(),
    limits: MediaLimits = MediaLimits(),
    item: str | None = None,
    until_s: float | None = None,
) -> AudioClip:
    """The first audio stream of ``data`` as mono float32 at ``cfg.sample_rate``; with
    ``until_s``, only its first ``until_s`` seconds or a little more (decoding stops after the
    frame that reaches it; the caps then apply to that much: a video's sound track beside its
    sampled frames, ``media_io.audio_track``).

    Raises:
        BadMedia: empty, corrupt or truncated bytes, no audio stream, or a stream with no samples.
        UnsupportedMedia: a codec this build cannot decode.
        MediaTooLarge: over ``limits.max_bytes`` or ``limits.max_audio_seconds``.
    """
    container = open_container(data, "audio", limits, item)
    with container:
        source, stream = _checked_stream(container, limits, item, until_s)
        samples = _decode_stream(container, stream, cfg.sample_rate, limits, item, until_s)
    if samples.size == 0:
        raise BadMedia(f"audio stream ({source.codec}) holds no samples", item)
    return AudioClip(samples, cfg.sample_rate, source)


def probe_audio(data: bytes, limits: MediaLimits = MediaLimits(), item: str | None = None) -> AudioSource:
    """What the first audio stream's header says, checked against ``limits`` (the errors of
    ``decode_audio``), with nothing decoded."""
    with open_container(data, "audio", limits, item) as container:
        return _checked_stream(container, limits, item)[0]


def _checked_stream(
    container: av.container.InputContainer,
    limits: MediaLimits,
    item: str | None,
    until_s: float | None = None,
) -> tuple[AudioSource, av.audio.stream.AudioStream]:
    require_stream(container, "audio", item)
    stream = container.streams.audio[0]
    ctx = stream.codec_context
    if ctx is None or not ctx.name or ctx.name == "none":
        # (PyAV gives no codec context, hence no name or tag, for a codec it does not know)
        raise UnsupportedMedia("audio codec unknown to this build cannot be decoded", item)
    source = AudioSource(
        ctx.name, int(ctx.sample_rate or 0), int(ctx.channels or 0), declared_seconds(container, stream)
    )
    if (
        source.sample_rate
        and not limits.min_audio_sample_rate <= source.sample_rate <= limits.max_audio_sample_rate
    ):
        raise BadMedia(
            f"audio sample rate {source.sample_rate} Hz is outside [{limits.min_audio_sample_rate}, "
            f"{limits.max_audio_sample_rate}] Hz",
            item,
        )
    if source.channels > limits.max_audio_channels:
        raise MediaTooLarge(
            f"audio has {source.channels} channels, above the limit of {limits.max_audio_channels}", item
        )
    wanted_s = source.declared_s if until_s is None else min(source.declared_s, until_s)
    if wanted_s > limits.max_audio_seconds:
        raise MediaTooLarge(_too_long(wanted_s, limits), item)
    return source, stream


def has_audio_stream(data: bytes) -> bool:
    """Whether the container holds an audio stream (headers only, nothing decoded): a video's
    sound track is encoded only when there is one. Unreadable bytes say False (the video's own
    decode reports them)."""
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            return bool(container.streams.audio)
    except (av.error.FFmpegError, ValueError, UnicodeDecodeError):
        return False


def _decode_stream(
    container: av.container.InputContainer,
    stream: av.audio.stream.AudioStream,
    rate: int,
    limits: MediaLimits,
    item: str | None,
    until_s: float | None = None,
) -> np.ndarray:
    """[N] float32 mono at ``rate`` (with ``until_s``: up to the frame that reaches it). The
    resampler keeps the source layout (planar float), so that the downmix is the plain channel
    mean (see the module docstring)."""
    resampler: av.AudioResampler | None = None
    cap = int(limits.max_audio_seconds * rate) + rate  # a second of slack for codec padding
    chunks: list[np.ndarray] = []
    total = 0

    def take(frames: list[av.AudioFrame]) -> None:
        nonlocal total
        for out in frames:
            planes = out.to_ndarray()  # [C, n] float32 (planar)
            chunks.append(planes.mean(axis=0, dtype=np.float32) if planes.shape[0] > 1 else planes[0])
            total += planes.shape[1]
        if total > cap:
            raise MediaTooLarge(_too_long(total / rate, limits), item)

    seconds_in = 0.0  # the input's own length, counted before a frame is resampled
    try:
        for frame in container.decode(stream):
            in_rate = frame.sample_rate or 0
            if not limits.min_audio_sample_rate <= in_rate <= limits.max_audio_sample_rate:
                raise BadMedia(f"audio frame at {in_rate} Hz (the header said otherwise)", item)
            if len(frame.layout.channels) > limits.max_audio_channels:
                raise MediaTooLarge(f"audio frame with {len(frame.layout.channels)} channels", item)
            seconds_in += frame.samples / in_rate
            if seconds_in > limits.max_audio_seconds + 1.0:
                raise MediaTooLarge(_too_long(seconds_in, limits), item)
            if resampler is None:  # the first frame tells the layout (headers may not)
                resampler = av.AudioResampler(format="fltp", layout=frame.layout.name, rate=rate)
            take(resampler.resample(frame))
            if until_s is not None and seconds_in >= until_s:
                break  # the rest of the stream is not wanted
        if resampler is not None:
            take(resampler.resample(None))  # what the resampler still holds
    except av.error.DecoderNotFoundError as e:
        raise UnsupportedMedia(f"audio codec {stream.codec_context.name!r} cannot be decoded", item) from e
    except (av.error.FFmpegError, ValueError) as e:
        raise BadMedia(f"cannot decode audio: {error_reason(e)}", item) from e
    if not chunks:
        return np.zeros(0, np.float32)
    return np.concatenate(chunks).astype(np.float32, copy=False)


def _too_long(seconds: float, limits: MediaLimits) -> str:
    return f"audio is {seconds:.1f} s long, above the {limits.max_audio_seconds:g}-second limit"
