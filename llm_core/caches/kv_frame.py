"""The framing every KV byte format here shares (a prefill/decode hand-off, a stored page)::

    offset 0   8-byte magic (name and version)
           8   u32 little-endian: header length
          12   header: JSON (sorted keys)
     aligned   body (64-byte aligned, so tensor views of it are aligned too)

``frame_head`` writes the part before the body; ``read_head`` checks the magic and the header's
bounds and returns the parsed JSON and where the body starts. Errors are ``FrameError`` (a
``ValueError``), which each format turns into its own error with what it was reading.
"""

from __future__ import annotations

import json
import struct
from typing import Any

ALIGN = 64


class FrameError(ValueError):
    """Bytes that are not a frame of the expected kind."""


def body_offset(header_len: int) -> int:
    return -(-(12 + header_len) // ALIGN) * ALIGN


def frame_head(magic: bytes, head: dict[str, Any]) -> bytes:
    """magic, header length, JSON header and the padding up to the body."""
    assert len(magic) == 8, magic
    header = json.dumps(head, sort_keys=True).encode()
    pad = body_offset(len(header)) - 12 - len(header)
    return magic + struct.pack("<I", len(header)) + header + bytes(pad)


def read_head(raw: memoryview, magic: bytes) -> tuple[Any, int]:
    """(the parsed header, the body's offset) of ``raw``; ``FrameError`` for a wrong magic, a header
    past the end or one that is not JSON."""
    if len(raw) < 12 or bytes(raw[:8]) != magic:
        raise FrameError("bad magic or version")
    (hlen,) = struct.unpack("<I", raw[8:12])
    if 12 + hlen > len(raw):
        raise FrameError("the header runs past the end")
    try:
        head = json.loads(bytes(raw[12 : 12 + hlen]))
    except ValueError as e:
        raise FrameError(f"unreadable header: {e}") from e
    return head, body_offset(hlen)
