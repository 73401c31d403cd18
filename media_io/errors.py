"""Typed errors for anything that came from a request's media.

Each error names the item it concerns (an index, a filename or a URL) and carries the HTTP status
the service maps it to at the edge. Internal invariants use ``assert`` instead.
"""

from __future__ import annotations


class MediaError(Exception):
    """Base class: one item's media could not be used. Other items and the process are unaffected."""

    status: int = 400
    kind: str = "bad_media"

    def __init__(self, message: str, item: str | None = None) -> None:
        self.message = message
        self.item = item
        super().__init__(f"{item}: {message}" if item else message)


class BadMedia(MediaError):
    """Corrupt, truncated or undecodable bytes (400)."""


class UnsupportedMedia(MediaError):
    """A format or content type we do not handle (415)."""

    status = 415
    kind = "unsupported_media_type"


class MediaTooLarge(MediaError):
    """Over a byte, pixel, frame or duration cap (413)."""

    status = 413
    kind = "media_too_large"


class FetchRefused(MediaError):
    """A URL refused by policy: SSRF guard, scheme, file root, redirect cap (400)."""

    kind = "fetch_refused"


class FetchFailed(MediaError):
    """The remote answered with an error or the connection failed (400)."""

    kind = "fetch_failed"


class FetchTimeout(MediaError):
    """The download did not finish within its timeout (504)."""

    status = 504
    kind = "fetch_timeout"
