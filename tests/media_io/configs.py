"""The preprocessing configs the media tests run under, written out from their public sources.

The values are spelled here rather than taken from ``media_io``, so a wrong default there shows
up as a parity failure instead of being shared by the test.
"""

from __future__ import annotations

from typing import Any

from media_io.config import PreprocessConfig

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# transformers' Qwen2VLImageProcessor / Qwen2VLVideoProcessor defaults.
QWEN2_VL = PreprocessConfig(
    patch_size=14,
    merge_size=2,
    temporal_patch_size=2,
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 1280,
    image_mean=_CLIP_MEAN,
    image_std=_CLIP_STD,
)

# MiMo-V2.5: config.json's processor_config (patch 16, merge 2, image and video bounds, 1 fps up
# to 3600 frames, the total video budget), with the OpenAI-CLIP mean/std that its
# preprocessor_config.json holds (sglang's MiMo processor @034439e9 says so; min_frames is null
# there, so its processor's fallback of 8 applies).
MIMO_V25 = PreprocessConfig(
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    min_pixels=8192,
    max_pixels=8388608,
    image_mean=_CLIP_MEAN,
    image_std=_CLIP_STD,
    fps=1.0,
    min_frames=8,
    max_frames=3600,
    video_min_pixels=8192,
    video_max_pixels=8388608,
    video_total_pixels=268435456,
    video_sampling="mimo_v2",
)

CONFIGS: dict[str, PreprocessConfig] = {"qwen2_vl": QWEN2_VL, "mimo_v25": MIMO_V25}


def reference_kwargs(cfg: PreprocessConfig, video: bool = False) -> dict[str, Any]:
    """transformers' Qwen2-VL image (or video) processor arguments that configure it like ``cfg``."""
    lo, hi = (cfg.video_min_pixels, cfg.video_max_pixels) if video else (cfg.min_pixels, cfg.max_pixels)
    return {
        "patch_size": cfg.patch_size,
        "merge_size": cfg.merge_size,
        "temporal_patch_size": cfg.temporal_patch_size,
        "size": {"shortest_edge": lo, "longest_edge": hi},
        "image_mean": list(cfg.image_mean),
        "image_std": list(cfg.image_std),
    }
