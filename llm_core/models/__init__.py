"""The language-model families (one module per family: ``mimo_v2_flash``, ``mimo_v2``,
``qwen2_5_vl``), the shared hybrid-SWA MoE decoder they configure, and the loader
(``checkpoint``) that reads a language model from a checkpoint directory.

Which family serves a checkpoint is the shared registry's answer
(``epd_common.checkpoint.registry``, by config.json's ``architectures``, else ``model_type``);
``family_for`` gives it the ``family.LLMFamily`` type. Adding a family is one module here and one
row there; an unknown architecture fails with the list of supported ones.

Beside ``epd_common`` (the checkpoint reader, the registry, the settings) it uses ``llm_core``'s
``backends`` (the kernels chosen once, handed over by ``after_load``), ``kernels``, ``prompts`` and
the request record (``positions``). The loader only reads: the embedded default's files (its
weights and distilled MTP heads) are written by a tools step, ``llm_core.tools.default_llm``.

May import: epd_common, llm_core.backends, llm_core.kernels, llm_core.prompts, llm_core.request;
never: llm_core.caches, llm_core.serving, llm_core.tools.
"""

from __future__ import annotations

from typing import Any, cast

from epd_common.checkpoint.errors import UnknownArchitecture
from epd_common.checkpoint.registry import language_family, supported_language_models
from llm_core.models.family import LLMFamily

__all__ = ["UnknownArchitecture", "family_for", "supported"]


def supported() -> list[str]:
    """Architecture names served, for error messages and docs."""
    return supported_language_models()


def family_for(raw: dict[str, Any]) -> LLMFamily:
    """The family of a config.json dict, by ``architectures``, or ``model_type`` when it names none."""
    return cast(LLMFamily, language_family(raw))
