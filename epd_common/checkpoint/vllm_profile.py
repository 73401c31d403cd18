"""How vLLM serves an architecture whose embeddings epd's encoders compute: the family's launch
profile, one per row of the registry (``registry.Architecture.vllm``).

    field           default (Qwen2.5-VL)      MiMo-V2.5 (MiMoV2ForCausalLM), vLLM 0.32
    launch_args     none                      --trust-remote-code (config.json's auto_map names
                                              the release's configuration_mimo_v2.py);
                                              --limit-mm-per-prompt {"image":0,"video":0,"audio":0}:
                                              vLLM's own towers stay unloaded (embeddings only)
    config_kept     none                      rope_theta, passed as --hf-overrides from config.json:
                                              under transformers 5 (vLLM 0.32 runs 5.19) a config
                                              class may fold it into rope_parameters, and vLLM's
                                              MiMo then runs its full-attention layers at 1e6
    served_as       none                      MiMoV2OmniForCausalLM: the class vLLM loads a
                                              MiMoV2ForCausalLM with a vision_config as
    embeds          image, video              image (as image_embeds + image_grid_thw; plain 1-D
                                              positions, which vLLM derives itself)
    refused_because -                         why a video or audio part is refused (415) before
                                              anything reaches vLLM

``launch_args`` go to the vLLM server ``epd serve --llm-server vllm`` starts (before the user's
``--vllm-arg``, which override them); ``served_as`` names the architecture checks accept beside
config.json's; ``embeds`` is what the vLLM backend hands on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class VLLMProfile:
    launch_args: tuple[str, ...] = ()
    # config.json fields vLLM reads as attributes of the loaded config: handed over as
    # --hf-overrides with config.json's values, whatever the checkpoint's config class keeps
    config_kept: tuple[str, ...] = ()
    served_as: tuple[str, ...] = ()
    embeds: frozenset[str] = field(default_factory=lambda: frozenset({"image", "video"}))
    refused_because: str = ""
    # the directory must hold the module config.json's auto_map.AutoConfig names (remote code)
    remote_config: bool = False


DEFAULT_VLLM = VLLMProfile()

# Embeddings only: with every limit 0 and --enable-mm-embeds, vLLM builds none of its towers (its
# windowed vision attention is Triton-only, so its CPU build could not run it) and takes
# image_embeds alone.
EMBEDS_ONLY = json.dumps({"image": 0, "video": 0, "audio": 0}, separators=(",", ":"))

MIMO_V25_VLLM = VLLMProfile(
    launch_args=("--trust-remote-code", "--limit-mm-per-prompt", EMBEDS_ONLY),
    config_kept=("rope_theta",),
    served_as=("MiMoV2OmniForCausalLM",),
    embeds=frozenset({"image"}),
    refused_because=(
        "vLLM 0.32 takes no embeddings for video or audio on MiMoV2OmniForCausalLM "
        "(video_embeds are refused, audio_embeds break the request)"
    ),
    remote_config=True,
)
