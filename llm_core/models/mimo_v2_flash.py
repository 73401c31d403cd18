"""MiMo-V2-Flash (``MiMoV2FlashForCausalLM``): hybrid full / sliding-window attention with sinks, MoE.

Config parsing is ``DecoderConfig.from_hf_dict`` (both transformers' and the original release's
spellings). Tensors keep their names; the multi-token-prediction heads (``model.mtp.*``) are not
part of the served model.
"""

from __future__ import annotations

from typing import Any

from llm_core.models.config import DecoderConfig
from llm_core.models.positions import LinearPositions, PositionScheme

ARCHITECTURES = ("MiMoV2FlashForCausalLM",)
MODEL_TYPES = ("mimo_v2_flash",)


def parse_config(raw: dict[str, Any]) -> DecoderConfig:
    return DecoderConfig.from_hf_dict(raw)


def tensor_name(disk_name: str) -> str | None:
    return None if disk_name.startswith("model.mtp.") else disk_name


def position_scheme(raw: dict[str, Any]) -> PositionScheme:
    return LinearPositions()
