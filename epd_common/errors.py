"""The one error channel towards clients, shared by every role's HTTP app.

Everything that came from a request and is wrong raises ``APIError``; ``error_response`` renders it
as ``{"error": {"type", "message", "param", "code"}}`` with its status. Other packages' typed errors
(media_io's ``MediaError``, which carries its own status) are rendered by the app that knows them,
with ``error_body``. Internal invariants use ``assert`` and surface as 500s, never as a client's
fault.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from epd_common.admission import retry_after_header

# A put the node cache refused because every entry it could evict is leased by requests in flight
# (``encoder.caches.cache_lease``): a retryable 503 of this type, whose ENTRY_BYTES_HEADER says how
# many bytes the entry needed (the ingress tells a request that can never fit from a busy cache).
CACHE_FULL = "cache_full"
ENTRY_BYTES_HEADER = "X-Entry-Bytes"


class APIError(Exception):
    """A request-level error with an HTTP status, an error type and the parameter it concerns."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.retry_after_s = retry_after_s


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unprocessable(message: str, param: str | None = None) -> APIError:
    """Schema errors: the body parsed but does not have the shape the route needs (422)."""
    return APIError(422, message, type="invalid_request_error", param=param)


def overloaded(message: str, retry_after_s: float = 1.0) -> APIError:
    return APIError(503, message, type="overloaded", retry_after_s=retry_after_s)


def error_body(status: int, type_: str, message: str, param: str | None) -> dict[str, Any]:
    return {"error": {"type": type_, "message": message, "param": param, "code": status}}


def error_response(exc: Exception) -> JSONResponse:
    """Map an exception raised while serving a request to a JSON error response."""
    if isinstance(exc, APIError):
        headers = {}
        if exc.retry_after_s is not None:
            headers["Retry-After"] = retry_after_header(exc.retry_after_s)  # never before the wait
        return JSONResponse(
            error_body(exc.status, exc.type, exc.message, exc.param), status_code=exc.status, headers=headers
        )
    return JSONResponse(
        error_body(500, "internal_error", f"internal error: {type(exc).__name__}", None), status_code=500
    )
