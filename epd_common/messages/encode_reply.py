"""EncodeReply: what an encoder worker answers the ingress for one item (``POST /encode``).

    {"ref": EmbeddingRef, "cache_hit": bool, "timings_ms": {"decode": ms, "forward": ms, ...}}

The worker encodes this Struct; the ingress decodes the body straight into it, strictly (a reply
that does not fit is the worker's fault, not the client's: the ingress tries the next worker).
"""

from __future__ import annotations

import msgspec

from epd_common.messages.embedding_ref import EmbeddingRef


class EncodeReply(msgspec.Struct, frozen=True):
    ref: EmbeddingRef
    cache_hit: bool = False  # found in the node cache, the shared store or an in-flight encode
    timings_ms: dict[str, float] = msgspec.field(default_factory=dict)  # per stage, this request's

    def encode(self) -> bytes:
        """The JSON body (every field present)."""
        return msgspec.json.encode(self)

    @classmethod
    def decode(cls, body: bytes) -> EncodeReply:
        """From a JSON body; ``msgspec.DecodeError`` / ``ValidationError`` (ValueErrors) naming
        what does not fit."""
        return msgspec.json.decode(body, type=cls, strict=True)
