"""The body a request goes to an LLM server as, and the few fields the pool reads or sets in it.

epd's own engine takes ``CompletionRequestBody`` (``epd_common.messages``): the Struct the engine
decodes is the one the ingress builds, so the schema is written once and a renamed field fails at
type-check time. Another server kind takes its own JSON, a dict in that server's names (vLLM's
chat and token routes): epd does not own that schema. Every kind shares ``max_tokens``, ``stream``
and ``stream_options``; the functions below read and set them on either.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from epd_common.messages.completion_request import CompletionRequestBody, StreamOptions

EngineBody = CompletionRequestBody | dict[str, Any]


def max_tokens(body: EngineBody) -> int | None:
    """The output budget the body asks (None: the server's default)."""
    value = body.max_tokens if isinstance(body, CompletionRequestBody) else body.get("max_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def streamed(body: EngineBody, stream: bool) -> EngineBody:
    """The body asking for a streamed answer or a whole one."""
    if isinstance(body, CompletionRequestBody):
        return msgspec.structs.replace(body, stream=stream)
    return {**body, "stream": stream}


def with_usage(body: EngineBody) -> EngineBody:
    """The body asking for the usage on a stream's last chunk."""
    if isinstance(body, CompletionRequestBody):
        return msgspec.structs.replace(body, stream_options=StreamOptions(include_usage=True))
    return {**body, "stream_options": {"include_usage": True}}


def includes_usage(body: EngineBody) -> bool:
    """Whether a stream of this body ends with the usage."""
    if isinstance(body, CompletionRequestBody):
        return bool(body.stream_options and body.stream_options.include_usage)
    options = body.get("stream_options")
    return isinstance(options, Mapping) and bool(options.get("include_usage"))
