"""EmbeddingRef: how an embedding travels between roles without its bytes.

The encoder writes the tensor into the node embedding cache and hands out this small record; the
LLM engine (or the ingress) reads the bytes zero-copy from the cache by ``key``, or fetches them
from ``url`` when the encoder runs on another node.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class EmbeddingRef:
    key: str  # MediaKey hex digest
    dtype: str  # "float32" | "bfloat16" | "float16"
    shape: tuple[int, int]  # [num_tokens, hidden]
    grid_thw: tuple[tuple[int, int, int], ...]  # one (t, h, w) in patches per image or video
    modality: str = "image"  # "image" | "video"
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
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["grid_thw"] = [list(g) for g in self.grid_thw]
        d["grid_t_timestamps"] = list(self.grid_t_timestamps)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EmbeddingRef:
        shape = tuple(int(x) for x in d["shape"])
        if len(shape) != 2:
            raise ValueError(f"EmbeddingRef.shape must have 2 dims, got {shape}")
        return cls(
            key=str(d["key"]),
            dtype=str(d["dtype"]),
            shape=(shape[0], shape[1]),
            grid_thw=tuple((int(g[0]), int(g[1]), int(g[2])) for g in d["grid_thw"]),
            modality=str(d.get("modality", "image")),
            url=d.get("url"),
            seconds_per_grid_t=None
            if d.get("seconds_per_grid_t") is None
            else float(d["seconds_per_grid_t"]),
            grid_t_timestamps=tuple(float(x) for x in d.get("grid_t_timestamps") or ()),
        )
