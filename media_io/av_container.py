"""Opening media bytes with PyAV, the same way for every decoder of a container (video, audio):
the empty and byte-size checks before anything is parsed, the open, the first stream of a kind,
the duration a header declares, and how an FFmpeg error reads in a client's message."""

from __future__ import annotations

import io
from typing import Literal

import av
import av.error

from media_io.config import MediaLimits
from media_io.errors import BadMedia, MediaTooLarge

StreamKind = Literal["video", "audio"]


def open_container(
    data: bytes, kind: StreamKind, limits: MediaLimits, item: str | None
) -> av.container.InputContainer:
    """``data`` opened for reading (the caller closes it). Raises BadMedia for empty or unreadable
    bytes, MediaTooLarge over ``limits.max_bytes``; the messages name ``kind``."""
    if not data:
        raise BadMedia(f"{kind} is empty (0 bytes)", item)
    if len(data) > limits.max_bytes:
        raise MediaTooLarge(f"{kind} is {len(data)} bytes, above the {limits.max_bytes}-byte limit", item)
    try:
        return av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError, UnicodeDecodeError) as e:
        raise BadMedia(f"cannot open {kind} container: {error_reason(e)}", item) from e


def require_stream(container: av.container.InputContainer, kind: StreamKind, item: str | None) -> None:
    """BadMedia naming the streams there are when ``container`` has no ``kind`` stream."""
    if not getattr(container.streams, kind):
        kinds = sorted({str(s.type) for s in container.streams}) or ["none"]
        raise BadMedia(f"container has no {kind} stream (streams: {', '.join(kinds)})", item)


def declared_seconds(container: av.container.InputContainer, stream: av.stream.Stream) -> float:
    """The stream's duration as its header declares it, else the container's; 0.0 when neither
    says (the decoder then counts while decoding)."""
    if stream.duration is not None and stream.time_base is not None and stream.duration > 0:
        return float(stream.duration * stream.time_base)
    if container.duration is not None and container.duration > 0:
        return container.duration / av.time_base
    return 0.0


def error_reason(e: BaseException) -> str:
    """An FFmpeg (or PyAV) error as a client reads it."""
    return getattr(e, "strerror", None) or str(e) or type(e).__name__
