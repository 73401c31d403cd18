"""The vision-tower families: one table from config.json's ``model_type`` to the module that
describes the family's checkpoints (``family.VisionFamily``), imported when first asked for.

Adding a tower family is one module and one line here; an unknown model_type fails with the list
of supported ones.
"""

from __future__ import annotations

import importlib
from typing import Any, cast

from encoder.models.family import VisionFamily

# model_type -> family module
FAMILIES: dict[str, str] = {
    "qwen2_5_vl": "encoder.models.qwen2_5_vl",
    "qwen2_5_vl_vision": "encoder.models.qwen2_5_vl",
    "mimo_v2": "encoder.models.mimo_v2",
}


class UnknownVisionModel(ValueError):
    """config.json's model_type names no tower family this build serves."""


def family_for(raw: dict[str, Any]) -> VisionFamily:
    model_type = raw.get("model_type")
    module = FAMILIES.get(str(model_type))
    if module is None:
        raise UnknownVisionModel(
            f"model_type {model_type!r} is not supported (supported: {', '.join(repr(m) for m in FAMILIES)})"
        )
    return cast(VisionFamily, importlib.import_module(module))
