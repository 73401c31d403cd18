"""The media seconds one request carries, against ``MediaLimits.max_request_media_seconds``.

Each item's own caps (``max_video_seconds``, ``max_audio_seconds``) bound one clip; a request of
64 items each just under them would still be 64 hours of decoding. So a request's clips share
one budget, counted twice:

    before any work   each audio or video item's duration as its container's header declares
                      it (``declared_media_seconds``: a header read, nothing decoded), added up
                      as the items arrive (``MediaSeconds.add``): past the budget, a 413
    after encoding    the seconds the encoded items really cover (an audio item's rows, a
                      video's temporal patches), added up the same way before the engine sees
                      them: a header that understated its clip is found here, its decode
                      already bounded by its own item cap

Images count nothing. This module reads container headers only.
"""

from __future__ import annotations

from media_io.av_container import StreamKind, declared_seconds, open_container, require_stream
from media_io.config import MediaLimits
from media_io.errors import MediaError, MediaTooLarge


def declared_media_seconds(
    data: bytes, modality: StreamKind, limits: MediaLimits, item: str | None = None
) -> float:
    """How long the first ``modality`` ("audio" or "video") stream of ``data`` says it is (0.0
    when its header does not say, or the bytes are not such a container: the decode reports
    those)."""
    try:
        with open_container(data, modality, limits, item) as container:
            require_stream(container, modality, item)
            stream = container.streams.audio[0] if modality == "audio" else container.streams.video[0]
            return declared_seconds(container, stream)
    except MediaError:
        return 0.0


class MediaSeconds:
    """One request's media seconds, added item by item against ``budget_s``."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.total_s = 0.0

    def add(self, seconds: float, item: str | None, what: str = "declared") -> None:
        """Count ``seconds`` of ``item``; ``MediaTooLarge`` (413) naming the item that crossed the
        budget and the flag that sets it. ``what``: how the seconds were known, for the message."""
        self.total_s += max(seconds, 0.0)
        if self.total_s > self.budget_s:
            raise MediaTooLarge(
                f"the request's audio and video last {self.total_s:.1f} s ({what}) with this item,"
                f" above the {self.budget_s:g} s one request may carry"
                " (--limits-max-request-media-seconds)",
                item,
            )
