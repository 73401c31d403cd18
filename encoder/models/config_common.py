"""What the vision-tower configs share (``config.VisionConfig`` for Qwen2.5-VL,
``mimo_vit_config.MiMoVisionConfig`` for MiMo ViT): the sizes derived from the patch geometry, and
the reading of a config.json ``vision_config`` dict into dataclass keyword arguments.

Each config stays its own frozen dataclass (its fields, checks and spelling on disk differ); these
are the parts whose logic is the same in both.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

# Keys of a vision_config that say nothing about the tower's math (HF bookkeeping), in every family.
HF_BOOKKEEPING: frozenset[str] = frozenset(
    {
        "model_type",
        "architectures",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "initializer_range",
        "_name_or_path",
    }
)
# Keys config.json files use for a field under another name (older Qwen2.5-VL files, MiMo's file).
ALIASES: dict[str, str] = {"in_chans": "in_channels", "num_attention_heads": "num_heads"}


class PatchGeometry:
    """Mixin for a config dataclass with these four fields: the derived sizes that
    ``family.VisionTowerConfig`` promises. Not a dataclass itself, so it adds no fields."""

    in_channels: int
    patch_size: int  # pixels per patch side
    temporal_patch_size: int  # frames per patch
    spatial_merge_size: int  # patches per merge-unit side

    @property
    def patch_dim(self) -> int:
        """Values in one input row: in_channels * temporal_patch * patch * patch (1176 / 1536)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        """Patches folded into one output row (4 for a 2x2 merge)."""
        return self.spatial_merge_size * self.spatial_merge_size


def read_known_keys(
    d: dict[str, Any], accepted: Collection[str], ignored: Collection[str], log: logging.Logger
) -> dict[str, Any]:
    """The entries of ``d`` whose key (after ``ALIASES``) is in ``accepted``, by field name.

    Keys neither accepted nor ``ignored`` are logged on ``log`` (the caller's, so the record names
    its config) and dropped: older transformers wrote generic PretrainedConfig fields (return_dict,
    ...) into vision_config, and refusing those would reject real checkpoints. A field that really
    changes the architecture also changes the tensors, which the loader checks strictly.
    """
    kwargs: dict[str, Any] = {}
    unknown: list[str] = []
    for raw_key, value in d.items():
        key = ALIASES.get(raw_key, raw_key)
        if key in accepted:
            kwargs[key] = value
        elif raw_key not in ignored:
            unknown.append(raw_key)
    if unknown:
        log.warning("ignoring unknown vision_config keys %s", sorted(unknown))
    return kwargs
