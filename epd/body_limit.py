"""ASGI middleware that caps request bodies.

A declared Content-Length over the cap is answered 413 before the body is read; a chunked body is
counted as it streams and the request fails with 413 as soon as it passes the cap, so an
oversize upload never sits in memory whole.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from epd.errors import APIError, error_response


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413, f"request body is larger than the limit of {limit} bytes", type="request_too_large"
        )


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

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
                    await error_response(BodyTooLarge(limit))(scope, receive, send)
                    return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counting_receive, send)
