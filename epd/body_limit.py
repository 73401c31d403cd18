"""ASGI middleware that caps request bodies.

A declared Content-Length over the cap is answered 413 without passing the request on; a chunked
body is counted as it streams and fails with 413 as soon as it passes the cap, so an oversize
upload never sits in memory whole.

Before answering, up to ``drain_bytes`` more of the body are read and dropped: a server that
answers and closes while the client is still sending makes the client see a broken pipe instead
of the 413 (the kernel resets a connection closed with unread data). Bodies larger than that
are cut off, and such clients may see the reset.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from epd_common.errors import APIError, error_response

DRAIN_BYTES = 16 * 1024 * 1024


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413, f"request body is larger than the limit of {limit} bytes", type="request_too_large"
        )


async def _drain(receive: Receive, budget: int) -> None:
    """Read and drop body messages until the body ends or ``budget`` bytes were dropped."""
    while budget > 0:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        budget -= len(message.get("body", b""))


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, drain_bytes: int = DRAIN_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.drain_bytes = drain_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > limit:
                    if declared <= limit + self.drain_bytes:
                        await _drain(receive, declared)
                    await error_response(BodyTooLarge(limit))(scope, receive, send)
                    return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    if message.get("more_body", False):
                        await _drain(receive, self.drain_bytes)
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counting_receive, send)
