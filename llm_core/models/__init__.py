"""The LLM model families: one table from config.json's ``architectures`` / ``model_type`` to the
module that implements ``models.family.LLMFamily``, imported when first asked for.

Adding a family is one module and one line here. An unknown architecture fails with the list of
supported ones.
"""

from __future__ import annotations

import importlib
from typing import Any, cast

from llm_core.models.family import LLMFamily

# architecture (or model_type) -> family module
FAMILIES: dict[str, str] = {
    "MiMoV2FlashForCausalLM": "llm_core.models.mimo_v2_flash",
    "mimo_v2_flash": "llm_core.models.mimo_v2_flash",
    "MiMoV2ForCausalLM": "llm_core.models.mimo_v2",
    "mimo_v2": "llm_core.models.mimo_v2",
    "Qwen2_5_VLForConditionalGeneration": "llm_core.models.qwen2_5_vl",
    "qwen2_5_vl": "llm_core.models.qwen2_5_vl",
}


class UnknownArchitecture(ValueError):
    """config.json names no architecture this build serves."""


def supported() -> list[str]:
    """Architecture names served, for error messages and docs."""
    return sorted(name for name in FAMILIES if name[:1].isupper())


def family_for(raw: dict[str, Any]) -> LLMFamily:
    """The family of a config.json dict, by ``architectures``, or ``model_type`` when it names none."""
    names = [str(a) for a in raw.get("architectures") or []]
    model_type = raw.get("model_type")
    # model_type only when no architecture is named: a named one we do not serve is an error
    for name in names or ([str(model_type)] if model_type else []):
        if name in FAMILIES:
            return cast(LLMFamily, importlib.import_module(FAMILIES[name]))
    asked = names or [repr(model_type)]
    raise UnknownArchitecture(
        f"architecture {', '.join(asked)} is not supported; supported: {', '.join(supported())}"
    )
