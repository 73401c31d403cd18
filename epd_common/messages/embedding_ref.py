"""EmbeddingRef: how an embedding travels between roles without its bytes.

The encoder writes the tensor into the node embedding cache and hands out this small record; the
LLM engine (or the ingress) reads the bytes zero-copy from the cache by ``key``, or fetches them
from ``url`` when the encoder runs on another node. On the wire it is a JSON object with every
field present (``to_json``); decoding is strict: a field of the wrong type is refused, naming it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

# The name of an embedding: the sha256 hex digest of the media bytes and everything that changes
# the embedding (``encoder.caches.media_key`` derives it). Any string the node cache accepts as a
# file name is carried; the cache refuses the rest.
MediaKey = Annotated[str, msgspec.Meta(description="MediaKey: a hex digest naming one embedding")]


class EmbeddingRef(msgspec.Struct, frozen=True):
    key: MediaKey
    dtype: str  # "float32" | "bfloat16" | "float16"
    shape: tuple[int, int]  # [num_tokens, hidden]
    # One (t, h, w) in patches per image or video. Audio: ((1, 1, n),) with n the clip's rows (one
    # per <|audio_pad|>, = shape[0]; no merge applies, so a reader takes the row count from shape).
    grid_thw: tuple[tuple[int, int, int], ...]
    modality: str = "image"  # "image" | "video" | "audio"
    url: str | None = None  # where to fetch the bytes when not in this node's cache
    # Video: seconds of the clip per temporal patch (temporal_patch_size / the sampled frame rate);
    # M-RoPE spaces a video's temporal positions by it. None for images.
    seconds_per_grid_t: float | None = None
    # Video: the time in seconds of each temporal patch (its first frame), one per grid t, in
    # order; a model that writes timestamps into the prompt (MiMo-V2.5) reads them. () otherwise.
    grid_t_timestamps: tuple[float, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.shape[0]

    def to_json(self) -> dict[str, Any]:
        """The JSON object (tuples as lists), every field present."""
        out: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(self))
        return out

    @classmethod
    def from_json(cls, d: object) -> EmbeddingRef:
        """From a decoded JSON object; ``msgspec.ValidationError`` (a ValueError) naming the field."""
        return msgspec.convert(d, cls, strict=True)
