"""preprocess_config_from_dir: the processor files of a checkpoint directory -> PreprocessConfig."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from encoder.caches.media_key import media_key
from media_io.config import PreprocessConfig
from media_io.processor_config import ProcessorConfigError, preprocess_config_from_dir
from tests.media_io.configs import MIMO_V25, QWEN2_VL

IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]

# MiMo-V2.5's config.json blocks as published (public dump of the checkpoint's config.json),
# trimmed to what matters here plus a few keys that change no pixels.
MIMO_PROCESSOR_CONFIG: dict[str, Any] = {
    "image_token_id": 151655,
    "video_token_id": 151656,
    "patch_size": 16,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "temporal_compression_ratio": 1,
    "image_min_pixels": 8192,
    "image_max_pixels": 8388608,
    "video_min_pixels": 8192,
    "video_max_pixels": 8388608,
    "video_total_max_pixels": 268435456,
    "fps": 1.0,
    "max_frames": 3600,
    "min_frames": None,
    "num_frames": None,
    "video_tokens_per_second": 2,
    "use_video_timestamps": True,
    "use_per_grid_t_timestamps": False,
    "audio_sampling_rate": 24000,
}
MIMO_VISION_CONFIG = {"patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3}
# A Qwen2-VL-style preprocessor_config.json with the keys the checkpoint's file has.
MIMO_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": 8192,
    "max_pixels": 8388608,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


def _write(
    root: Path,
    block: dict[str, Any] | None,
    preprocessor: dict[str, Any] | None,
    vision: dict[str, Any] | None = None,
) -> Path:
    config: dict[str, Any] = {"model_type": "mimo_v2", "vision_config": vision or MIMO_VISION_CONFIG}
    if block is not None:
        config["processor_config"] = block
    (root / "config.json").write_text(json.dumps(config))
    if preprocessor is not None:
        (root / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return root


def test_mimo_checkpoint_reads_to_the_mimo_config(tmp_path: Path) -> None:
    cfg = preprocess_config_from_dir(_write(tmp_path, MIMO_PROCESSOR_CONFIG, MIMO_PREPROCESSOR))
    assert cfg == MIMO_V25
    assert cfg.video_sampling == "mimo_v2" and cfg.factor == 32 and cfg.row_size == 1536
    assert cfg.min_frames == 8  # null in the block: its processor's fallback


def test_mean_std_come_from_preprocessor_config_as_transformers_reads_it(tmp_path: Path) -> None:
    pre = {**MIMO_PREPROCESSOR, "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD}
    cfg = preprocess_config_from_dir(_write(tmp_path, MIMO_PROCESSOR_CONFIG, pre))
    ref = Qwen2VLImageProcessorPil.from_pretrained(str(tmp_path))
    assert cfg.image_mean == tuple(ref.image_mean) == tuple(IMAGENET_MEAN)
    assert cfg.image_std == tuple(ref.image_std) == tuple(IMAGENET_STD)
    assert (cfg.patch_size, cfg.merge_size) == (ref.patch_size, ref.merge_size) == (16, 2)
    assert (cfg.min_pixels, cfg.max_pixels) == (ref.size["shortest_edge"], ref.size["longest_edge"])


def test_precedence_block_then_files_then_block_defaults(tmp_path: Path) -> None:
    block = {**MIMO_PROCESSOR_CONFIG, "image_max_pixels": None, "video_total_max_pixels": None, "fps": None}
    del block["video_max_pixels"]
    pre = {**MIMO_PREPROCESSOR, "min_pixels": 3136, "max_pixels": 1_000_000}
    cfg = preprocess_config_from_dir(_write(tmp_path, block, pre))
    assert cfg.min_pixels == 8192  # 1. the block's value wins over preprocessor_config.json's 3136
    assert cfg.max_pixels == 1_000_000  # 2. null in the block: preprocessor_config.json's
    f = 32  # 3. in neither: the block's processor defaults, in units of (patch * merge)^2
    assert cfg.video_max_pixels == 4096 * f * f
    assert cfg.video_total_pixels == 16384 * f * f
    assert cfg.fps == 2.0


def test_patch_geometry_falls_back_to_vision_config(tmp_path: Path) -> None:
    block = {k: v for k, v in MIMO_PROCESSOR_CONFIG.items() if k not in ("patch_size", "merge_size")}
    cfg = preprocess_config_from_dir(_write(tmp_path, block, None))
    assert (cfg.patch_size, cfg.merge_size) == (16, 2)
    assert cfg.image_mean == QWEN2_VL.image_mean  # no preprocessor_config.json: base's (CLIP)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_frames": 16}, r"processor_config\.num_frames"),
        ({"temporal_compression_ratio": 2}, r"processor_config\.temporal_compression_ratio"),
        ({"fps": "fast"}, r"processor_config\.fps"),
        ({"image_max_pixels": 8.5}, r"processor_config\.image_max_pixels"),
        ({"max_frames": 0}, r"max_frames must be a positive int"),
    ],
)
def test_bad_block_values_are_errors_naming_the_file_and_key(
    tmp_path: Path, change: dict[str, Any], match: str
) -> None:
    _write(tmp_path, {**MIMO_PROCESSOR_CONFIG, **change}, MIMO_PREPROCESSOR)
    with pytest.raises(ProcessorConfigError, match=match) as info:
        preprocess_config_from_dir(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_without_the_block_the_qwen_files_are_read_as_before(tmp_path: Path) -> None:
    pre = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2}
    cfg = preprocess_config_from_dir(_write(tmp_path, None, pre, vision={"patch_size": 16}))
    assert cfg == dataclasses.replace(QWEN2_VL, max_pixels=12845056)
    assert cfg.video_sampling == "qwen2_vl"
    # transformers 5's processor_config.json with nested processors wins over preprocessor_config.json
    (tmp_path / "processor_config.json").write_text(
        json.dumps(
            {
                "image_processor": {"size": {"shortest_edge": 1024, "longest_edge": 2048 * 28 * 28}},
                "video_processor": {"fps": 1.0, "max_video_tokens": 1000},
            }
        )
    )
    cfg = preprocess_config_from_dir(tmp_path)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.fps) == (1024, 2048 * 28 * 28, 1.0)
    assert cfg.video_total_pixels == int(1000 * 28 * 28 * 0.9)
    assert preprocess_config_from_dir(tmp_path / "missing") == PreprocessConfig()


def test_the_mimo_settings_key_their_own_embeddings(tmp_path: Path) -> None:
    cfg = preprocess_config_from_dir(_write(tmp_path, MIMO_PROCESSOR_CONFIG, MIMO_PREPROCESSOR))
    keys = {
        media_key(b"x", "video", c, "fp")
        for c in (QWEN2_VL, cfg, dataclasses.replace(cfg, video_sampling="qwen2_vl"))
    }
    assert len(keys) == 3  # the sampling rule alone changes the key
