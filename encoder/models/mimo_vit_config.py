"""MiMoVisionConfig: the shape of the MiMo-V2.5 vision tower ("MiMoVL ViT"), from config.json's
``vision_config`` (see /work/shared/reference/mimo_v25.md sections 1 and 2).

The real file's gotchas, handled here:
    ``in_chans`` (not ``in_channels``); no ``qk_channels`` / ``kv_channels`` keys, which default to
    64 (head_dim 64, not hidden/heads = 40); no norm eps key (1e-6 everywhere); ``window_size``
    (128) is unused, the band half-width is ``visual_token_window_size``; ``num_query_groups`` and
    ``spatial_patch_size`` only restate other fields (checked, not stored).

Per block the attention mode comes from ``vit_window_attn_types`` (-1 full, 0 row band, 1 column
band). ``fullatt_block_indexes`` restates which blocks are full; the reference code decides the
band from it and the order from the types, so the two must agree (a config where they disagree is
refused rather than read one way or the other). Sinks exist on the banded blocks when ``use_sink``.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

from encoder.models.config_common import HF_BOOKKEEPING, PatchGeometry, read_known_keys
from encoder.models.tower import ACTIVATIONS

log = logging.getLogger(__name__)

FULL, ROW_BAND, COLUMN_BAND = -1, 0, 1

# Keys that say nothing about the tower's math: HF bookkeeping, LLM-side hints (tokens_per_second
# feeds the LLM's video positions), and window_size, which no MiMo code path reads.
_IGNORED: frozenset[str] = HF_BOOKKEEPING | {"tokens_per_second", "window_size"}
# Keys that restate other fields: checked against them, never stored.
_RESTATED = ("num_query_groups", "spatial_patch_size")

_REAL_TYPES = (-1, 0, 0, 0, 0, 1, 1, 1, 1) * 3 + (-1,)


class BlockMode(NamedTuple):
    """How one block attends (within a frame always)."""

    band: int | None  # key j is visible to query i when |i - j| <= band (current order); None: all
    column: bool  # the block runs on the column-major merge-unit order
    sinks: bool  # the block has ``attn.sinks`` (a per-head bias on key 0's logit)


@dataclass(frozen=True)
class MiMoVisionConfig(PatchGeometry):
    """MiMo-V2.5 vision tower hyper-parameters (defaults: the released checkpoint's values).

    Invariants (``__post_init__``): GQA heads divide; the head dim divides by 4 (2-D rotary);
    one attention type per block, each -1/0/1, and -1 exactly at ``fullatt_block_indexes``.
    """

    depth: int = 28
    hidden_size: int = 1280
    intermediate_size: int = 4608
    num_heads: int = 32
    num_key_value_heads: int = 8
    qk_channels: int = 64
    kv_channels: int = 64
    out_hidden_size: int = 4096
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    fullatt_block_indexes: tuple[int, ...] = (0, 9, 18, 27)
    vit_window_attn_types: tuple[int, ...] = _REAL_TYPES
    visual_token_window_size: int = 64
    use_sink: bool = True
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6  # blocks' RMSNorm and the merger's LayerNorm (R1, L1)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_key_value_heads}"
            )
        if self.qk_channels % 4:
            raise ValueError(
                f"qk_channels {self.qk_channels} must be divisible by 4 for the 2D rotary embedding"
            )
        if self.kv_channels != self.qk_channels:
            raise ValueError(
                f"kv_channels {self.kv_channels} != qk_channels {self.qk_channels} is not supported"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not one of {sorted(ACTIVATIONS)}")
        if len(self.vit_window_attn_types) != self.depth:
            raise ValueError(
                f"vit_window_attn_types has {len(self.vit_window_attn_types)} entries for depth {self.depth}"
            )
        bad = sorted({t for t in self.vit_window_attn_types if t not in (FULL, ROW_BAND, COLUMN_BAND)})
        if bad:
            raise ValueError(f"vit_window_attn_types values {bad} are not -1 (full), 0 (row) or 1 (column)")
        outside = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if outside:
            raise ValueError(f"fullatt_block_indexes {outside} are outside [0, depth={self.depth})")
        typed_full = tuple(i for i, t in enumerate(self.vit_window_attn_types) if t == FULL)
        if typed_full != tuple(sorted(set(self.fullatt_block_indexes))):
            raise ValueError(
                f"fullatt_block_indexes {list(self.fullatt_block_indexes)} disagree with the -1 entries "
                f"of vit_window_attn_types (blocks {list(typed_full)})"
            )
        if self.visual_token_window_size == 0:
            raise ValueError("visual_token_window_size 0 is not supported (>= 1, or < 0 for no band)")

    @property
    def head_dim(self) -> int:
        return self.qk_channels

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused qkv projection: [Q heads*D | K kv_heads*D | V kv_heads*D]."""
        return (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim

    def block_mode(self, block: int) -> BlockMode:
        kind = self.vit_window_attn_types[block]
        if kind == FULL:
            return BlockMode(band=None, column=False, sinks=False)
        band = self.visual_token_window_size if self.visual_token_window_size > 0 else None
        return BlockMode(band=band, column=kind == COLUMN_BAND, sinks=self.use_sink)

    def to_dict(self) -> dict[str, Any]:
        """Canonical JSON-able form (used by the checkpoint fingerprint)."""
        d = asdict(self)
        d["fullatt_block_indexes"] = list(self.fullatt_block_indexes)
        d["vit_window_attn_types"] = list(self.vit_window_attn_types)
        return d

    def to_vision_config(self) -> dict[str, Any]:
        """The ``vision_config`` body in the real file's spelling (plus explicit qk/kv channels)."""
        d = self.to_dict()
        d["in_chans"] = d.pop("in_channels")
        d.pop("rms_norm_eps")
        d.pop("rope_theta")
        d["num_query_groups"] = self.num_heads // self.num_key_value_heads
        d["spatial_patch_size"] = self.patch_size
        d["tokens_per_second"] = 2
        d["window_size"] = 128
        return d

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that loads as this tower: the full model's layout, vision part only."""
        return {
            "model_type": "mimo_v2",
            "architectures": ["MiMoV2ForCausalLM"],
            "vision_model_type": "mimovl",
            "vision_config": self.to_vision_config(),
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> MiMoVisionConfig:
        """Build from a ``vision_config`` dict. Unknown keys are logged and ignored (a field that
        changes the architecture also changes the tensors, which the loader checks strictly);
        inconsistent values raise ``ValueError`` naming the field."""
        kwargs = read_known_keys(d, {f.name for f in fields(cls)}, _IGNORED | set(_RESTATED), log)
        for key in ("fullatt_block_indexes", "vit_window_attn_types"):
            if kwargs.get(key) is not None:
                kwargs[key] = tuple(int(i) for i in kwargs[key])
        types, full = kwargs.get("vit_window_attn_types"), kwargs.get("fullatt_block_indexes")
        # Either list may be missing or empty (the reference then reads the other): derive it.
        if not types:
            kwargs.pop("vit_window_attn_types", None)
            if full is not None:
                depth = int(kwargs.get("depth", cls.depth))
                kwargs["vit_window_attn_types"] = tuple(FULL if i in full else ROW_BAND for i in range(depth))
        elif full is None:
            kwargs["fullatt_block_indexes"] = tuple(i for i, t in enumerate(types) if t == FULL)
        cfg = cls(**kwargs)
        if "spatial_patch_size" in d and int(d["spatial_patch_size"]) != cfg.patch_size:
            raise ValueError(f"spatial_patch_size {d['spatial_patch_size']} != patch_size {cfg.patch_size}")
        groups = d.get("num_query_groups")
        if groups is not None and int(groups) != cfg.num_heads // cfg.num_key_value_heads:
            raise ValueError(
                f"num_query_groups {groups} != num_heads / num_key_value_heads "
                f"({cfg.num_heads}/{cfg.num_key_value_heads})"
            )
        return cfg
