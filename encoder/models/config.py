"""VisionConfig: the shape of a Qwen2.5-VL vision tower, mirroring transformers' ``vision_config``.

It knows nothing of weights or files; ``encoder/models/checkpoint.py`` reads ``config.json`` and calls
``VisionConfig.from_hf_dict`` on the vision part.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields
from typing import Any

from encoder.models.config_common import HF_BOOKKEEPING, PatchGeometry, read_known_keys

log = logging.getLogger(__name__)

# Keys that say nothing about the tower's math (HF bookkeeping, text-side hints), or that
# from_hf_dict reads itself (rope_parameters, rope_theta).
_IGNORED: frozenset[str] = HF_BOOKKEEPING | {
    "tokens_per_second",
    "spatial_patch_size",
    "rope_parameters",
    "rope_theta",
    "num_hidden_layers",
}


@dataclass(frozen=True)
class VisionConfig(PatchGeometry):
    """Qwen2.5-VL vision tower hyper-parameters (names as in transformers' ``Qwen2_5_VLVisionConfig``).

    Invariants (checked in ``__post_init__``): ``hidden_size`` divides by ``num_heads``; the head
    dim divides by 4 (2D rotary: half the rotated pairs for rows, half for columns); every
    ``fullatt_block_indexes`` entry is a block index; the window spans a whole number of merged
    patches.
    """

    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    out_hidden_size: int = 3584
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise ValueError(f"head_dim {self.head_dim} must be divisible by 4 for the 2D rotary embedding")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"fullatt_block_indexes {bad} are outside [0, depth={self.depth})")
        if self.window_merged < 1:
            raise ValueError(
                f"window_size {self.window_size} is smaller than one merged patch "
                f"({self.spatial_merge_size * self.patch_size} pixels)"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def window_merged(self) -> int:
        """Window side in merged patches: window_size // spatial_merge_size // patch_size."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    def is_full_attention(self, block: int) -> bool:
        return block in self.fullatt_block_indexes

    def to_dict(self) -> dict[str, Any]:
        """Canonical JSON-able form (used by the checkpoint fingerprint)."""
        d = asdict(self)
        d["fullatt_block_indexes"] = list(self.fullatt_block_indexes)
        return d

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` body of a vision-only transformers checkpoint."""
        d = self.to_dict()
        rope_theta = d.pop("rope_theta")
        d.pop("rms_norm_eps")
        d["model_type"] = "qwen2_5_vl_vision"
        d["architectures"] = ["Qwen2_5_VisionTransformerPretrainedModel"]
        d["rope_parameters"] = {"rope_type": "axial", "rope_theta": rope_theta}
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> VisionConfig:
        """Build from a transformers ``vision_config`` dict (either the 5.x or the original layout).

        Unknown keys are logged and ignored; values this tower cannot run (non-axial rope,
        non-square patches, inconsistent sizes) raise ``ValueError`` naming them.
        """
        # rope_theta is read below, from rope_parameters first (transformers 5's layout).
        accepted = {f.name for f in fields(cls)} - {"rope_theta"}
        kwargs = read_known_keys(d, accepted, _IGNORED, log)
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise ValueError(
                f"vision rope_type {rope.get('rope_type')!r} is not supported (expected 'axial')"
            )
        kwargs["rope_theta"] = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        for key in ("patch_size", "temporal_patch_size"):
            if isinstance(kwargs.get(key), list | tuple):
                raise ValueError(f"non-square {key} {kwargs[key]} is not supported")
        if "fullatt_block_indexes" in kwargs:
            kwargs["fullatt_block_indexes"] = tuple(int(i) for i in kwargs["fullatt_block_indexes"])
        return cls(**kwargs)
