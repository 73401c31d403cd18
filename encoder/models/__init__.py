"""The vision-tower families (one module per family: ``qwen2_5_vl``, ``mimo_v2``), the towers they
build, and the loader (``checkpoint``) that reads a tower from a checkpoint directory.

Which family serves a checkpoint is the shared registry's answer
(``epd_common.checkpoint.registry``, by config.json's model_type); ``family_for`` gives it the
``family.VisionFamily`` type. Adding a tower family is one module here and one row there.

Beside ``epd_common`` (the checkpoint reader, the registry, the settings) and the kernels, a tower
takes from ``media_io`` only its input contract: the audio settings and the pad-count rule (leaf
modules of settings); fetching and decoding stay out.

May import: encoder.kernels, epd_common, media_io.audio_config, media_io.audio_settings,
media_io.audio_tokens; never: encoder.caches, encoder.serving, media_io, llm_core, epd.
"""

from __future__ import annotations

from typing import Any, cast

from encoder.models.family import VisionFamily
from epd_common.checkpoint.registry import tower_family


def family_for(raw: dict[str, Any]) -> VisionFamily:
    """The tower family of a config.json dict; ``UnknownArchitecture`` naming the supported
    model types."""
    return cast(VisionFamily, tower_family(raw))
