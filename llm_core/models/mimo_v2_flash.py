"""MiMo-V2-Flash (``MiMoV2FlashForCausalLM``): hybrid full / sliding-window attention with sinks, MoE.

Config parsing is ``DecoderConfig.from_hf_dict`` (both transformers' and the original release's
spellings). Tensors keep their names; the multi-token-prediction heads (``model.mtp.layers.{i}.*``,
the release ships 3) map to ``mtp.`` names and are loaded into ``mtp.MTPHeads``, as for MiMo-V2.5,
when config.json declares them (``num_nextn_predict_layers`` > 0, as the release and the embedded
default do). transformers' ``MiMoV2FlashConfig`` has no such field and its model drops
``model.mtp.*`` on load, so a checkpoint whose config.json does not declare the heads keeps that
behaviour here: its ``model.mtp.*`` tensors are not read (``MTP_NEEDS_DECLARATION``, read by
``checkpoint.load_llm``).
"""

from __future__ import annotations

from typing import Any

from llm_core.models.config import DecoderConfig
from llm_core.models.mtp import MTP_PREFIX
from llm_core.models.positions import LinearPositions, PositionScheme

# model.mtp.* are heads only when config.json's num_nextn_predict_layers says so (see above).
MTP_NEEDS_DECLARATION = True


def parse_config(raw: dict[str, Any]) -> DecoderConfig:
    return DecoderConfig.from_hf_dict(raw)


def tensor_name(disk_name: str) -> str | None:
    if disk_name.startswith("model.mtp."):
        return MTP_PREFIX + disk_name.removeprefix("model.mtp.")
    return disk_name


def position_scheme(raw: dict[str, Any]) -> PositionScheme:
    return LinearPositions()
