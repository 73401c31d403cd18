"""The registry of the architectures this build serves: config.json -> the language-model family,
the tower family and the processor settings, one row per architecture.

    architecture                             language family  tower family  audio family  processor
    MiMoV2FlashForCausalLM                   mimo_v2_flash    -             -             Qwen2-VL's
    MiMoV2ForCausalLM (vLLM: MiMoV2Omni...)  mimo_v2          mimo_v2       mimo_audio    config.json's processor_config
    Qwen2_5_VLForConditionalGeneration       qwen2_5_vl       qwen2_5_vl    -             Qwen2-VL's
    Qwen2_5_VisionTransformerPretrainedModel -                qwen2_5_vl    -             Qwen2-VL's

A family is named by its module's import path and imported when first asked for, so this module
(which the encoder, the LLM engine, the media code and epd all import) loads neither model stack.
The modules implement ``llm_core.models.family.LLMFamily`` / ``encoder.models.family.VisionFamily`` (an audio family:
``missing_part``, ``settings`` and ``load``, as ``encoder.models.mimo_audio.family``);
``llm_core.models.family_for`` and ``encoder.models.family_for`` give them their types.

Each row also carries how a vLLM server serves it (``vllm_profile.VLLMProfile``: launch flags,
the class name vLLM loads it as, the embeddings it takes); MiMo-V2.5's differs from the default.

Lookup rules (those of the released checkpoints' own loaders):

- an architecture is found by config.json's ``architectures`` (the first one served; the name vLLM
  loads it as counts too), or by its ``model_type`` when it names none: a named architecture this
  build does not serve is an error;
- a tower family is found by ``model_type``, which is what a tower's config is dispatched on
  (vision-only checkpoints and fine-tunes renamed in ``architectures`` keep it).

Adding a model is one family module per role and one row here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from epd_common.checkpoint.errors import UnknownArchitecture
from epd_common.checkpoint.vllm_profile import DEFAULT_VLLM, MIMO_V25_VLLM, VLLMProfile


@dataclass(frozen=True)
class ProcessorSpec:
    """How a checkpoint's processor settings are found beyond the processor files
    (``media_io.processor_config``)."""

    # config.json's block of the processor's own settings (MiMo-V2.5: "processor_config"), or None
    settings_block: str | None = None
    # the video sampling rule (``media_io.config.VideoSamplingRule``) when that block is present
    video_sampling: str = "qwen2_vl"


QWEN2_VL_PROCESSOR = ProcessorSpec()


@dataclass(frozen=True)
class Architecture:
    """One served architecture."""

    name: str  # config.json's architectures[0]
    model_types: tuple[str, ...]  # config.json's model_type values for it
    language: str | None  # import path of its LLMFamily module; None: no language model
    tower: str | None  # import path of its VisionFamily module; None: no vision tower
    processor: ProcessorSpec = QWEN2_VL_PROCESSOR
    # import path of its audio family module (``encoder.models.audio_checkpoint``); None: no audio
    audio: str | None = None
    # how a vLLM server is started for it and what it takes (``vllm_profile``); its ``served_as``
    # names are found as this architecture too
    vllm: VLLMProfile = DEFAULT_VLLM

    def language_module(self) -> ModuleType:
        if self.language is None:
            raise UnknownArchitecture(f"architecture {self.name} has no language model")
        return importlib.import_module(self.language)


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("MiMoV2FlashForCausalLM", ("mimo_v2_flash",), "llm_core.models.mimo_v2_flash", None),
    Architecture(
        "MiMoV2ForCausalLM",
        ("mimo_v2",),
        "llm_core.models.mimo_v2",
        "encoder.models.mimo_v2",
        ProcessorSpec(settings_block="processor_config", video_sampling="mimo_v2"),
        audio="encoder.models.mimo_audio.family",
        vllm=MIMO_V25_VLLM,
    ),
    Architecture(
        "Qwen2_5_VLForConditionalGeneration",
        ("qwen2_5_vl",),
        "llm_core.models.qwen2_5_vl",
        "encoder.models.qwen2_5_vl",
    ),
    # the tower alone, as transformers saves the vision model (the encoder's embedded default)
    Architecture(
        "Qwen2_5_VisionTransformerPretrainedModel", ("qwen2_5_vl_vision",), None, "encoder.models.qwen2_5_vl"
    ),
)
_BY_NAME: dict[str, Architecture] = {n: a for a in ARCHITECTURES for n in (a.name, *a.vllm.served_as)}
_BY_MODEL_TYPE: dict[str, Architecture] = {t: a for a in ARCHITECTURES for t in a.model_types}


def supported_language_models() -> list[str]:
    """The architectures with a language model, sorted (for error messages and docs)."""
    return sorted(a.name for a in ARCHITECTURES if a.language is not None)


def supported_towers() -> list[str]:
    """The model_type values with a tower family, in table order."""
    return [t for a in ARCHITECTURES if a.tower is not None for t in a.model_types]


def find_architecture(raw: dict[str, Any]) -> Architecture | None:
    """The architecture of a config.json dict (see the lookup rules above), or None."""
    names = [str(a) for a in raw.get("architectures") or []]
    if names:
        return next((_BY_NAME[n] for n in names if n in _BY_NAME), None)
    model_type = raw.get("model_type")
    return _BY_MODEL_TYPE.get(str(model_type)) if model_type else None


def language_architecture(raw: dict[str, Any]) -> Architecture:
    """The served architecture of a config.json dict that has a language model;
    ``UnknownArchitecture`` naming the supported ones."""
    arch = find_architecture(raw)
    if arch is None or arch.language is None:
        asked = [str(a) for a in raw.get("architectures") or []] or [repr(raw.get("model_type"))]
        raise UnknownArchitecture(
            f"architecture {', '.join(asked)} is not supported; supported: "
            f"{', '.join(supported_language_models())}"
        )
    return arch


def language_family(raw: dict[str, Any]) -> ModuleType:
    """The LLM family module of a config.json dict; ``UnknownArchitecture`` naming the supported."""
    return language_architecture(raw).language_module()


def tower_family(raw: dict[str, Any]) -> ModuleType:
    """The tower family module of a config.json dict, by model_type; ``UnknownArchitecture``
    naming the supported model types."""
    model_type = raw.get("model_type")
    arch = _BY_MODEL_TYPE.get(str(model_type))
    if arch is None or arch.tower is None:
        raise UnknownArchitecture(
            f"model_type {model_type!r} is not supported "
            f"(supported: {', '.join(repr(m) for m in supported_towers())})"
        )
    return importlib.import_module(arch.tower)


def audio_family(raw: dict[str, Any]) -> ModuleType | None:
    """The audio family module of a config.json dict, by model_type (as the tower's); None when
    the architecture has no audio encoder."""
    arch = _BY_MODEL_TYPE.get(str(raw.get("model_type")))
    return None if arch is None or arch.audio is None else importlib.import_module(arch.audio)


def vllm_profile(raw: dict[str, Any]) -> VLLMProfile:
    """How vLLM serves a config.json dict's architecture (the default profile for one not served)."""
    arch = find_architecture(raw)
    return DEFAULT_VLLM if arch is None else arch.vllm


def processor_spec(raw: dict[str, Any]) -> ProcessorSpec:
    """The processor settings of a config.json dict (Qwen2-VL's for an architecture not served)."""
    arch = find_architecture(raw)
    return QWEN2_VL_PROCESSOR if arch is None else arch.processor
