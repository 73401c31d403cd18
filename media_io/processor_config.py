"""``PreprocessConfig`` from a checkpoint directory's processor files, as its processors read them.

    processor_config.json       {"image_processor": {...}, "video_processor": {...}} (transformers 5)
    preprocessor_config.json    the image processor (every release), used when the above has none
    video_preprocessor_config.json   the video processor, likewise
    config.json                 {"processor_config": {...}}: MiMo-V2.5's own processor settings

Image fields: ``patch_size``, ``temporal_patch_size``, ``merge_size``, ``image_mean``,
``image_std``, and the pixel bounds as ``size.shortest_edge`` / ``size.longest_edge`` (what the
processors use) or ``min_pixels`` / ``max_pixels`` (what released configs also write; these win
when both are there, as transformers' image processor lets them override ``size``). Video fields: ``fps``, ``min_frames``,
``max_frames``, the per-frame pixel bounds the same way, and ``max_video_tokens`` (the total pixel
budget is 90% of it, in 28x28 units, as the video processor caps frames). Absent fields keep
``base``'s values.

MiMo-V2.5 keeps its processor's settings in a ``processor_config`` block inside config.json (the
shared registry, ``epd_common.checkpoint.registry``, says which architectures have such a block
and which video rule it selects; ``patch_size``, ``merge_size``, ``temporal_patch_size``, ``image_min_pixels``,
``image_max_pixels``, ``video_min_pixels``, ``video_max_pixels``, ``video_total_max_pixels``,
``fps``, ``max_frames``, ``min_frames``, ...; token ids and audio settings there change no pixels
and are not read), next to a Qwen2-VL-style preprocessor_config.json. Its presence selects that
processor's video rule (``video_sampling="mimo_v2"``, see ``media_io.video_sampling``): the
spelling names the processor, as a processor class would. Precedence, per field, highest first:

1. the block's value, when not null. It is what MiMo's processor is built from on both the
   encoder and the language side (sglang's ``MiMoProcessor.from_hf_config`` reads only it, so the
   two sides agree on every grid);
2. the processor files above: image_mean / image_std come from preprocessor_config.json (the
   block has none; the reference path, transformers' Qwen2VLImageProcessor, reads them there),
   and so does any field the block leaves out or null;
3. for the block's own fields, its processor's defaults: patch geometry from config.json's
   ``vision_config`` (``patch_size``, ``spatial_merge_size``, ``temporal_patch_size``), then with
   ``f = patch * merge``: image and video min pixels 4 f^2, max 4096 f^2, total 16384 f^2, fps 2,
   max_frames 256, min_frames 8 (sglang's fallbacks; MiMo-V2.5 writes ``min_frames: null``, so
   its clips get at least 8 frames);
4. ``base``.

Block settings this code does not implement are refused (``num_frames``: a fixed frame count;
``temporal_compression_ratio`` other than 1) rather than silently ignored. The result is what
enters every MediaKey, so a checkpoint with other settings never shares cached embeddings with
this one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from epd_common.checkpoint.config_json import CONFIG_FILE, read_json_object
from epd_common.checkpoint.errors import CheckpointError
from epd_common.checkpoint.registry import processor_spec
from media_io.config import PreprocessConfig


class ProcessorConfigError(ValueError):
    """A processor file that cannot be read or holds a bad value; names the file and field."""


def preprocess_config_from_dir(
    model_dir: str | Path, base: PreprocessConfig = PreprocessConfig()
) -> PreprocessConfig:
    """``base`` updated with the processor settings found in ``model_dir`` (none: ``base``)."""
    root = Path(model_dir)
    fields = _processor_files(root, base)
    config_path = root / CONFIG_FILE
    config = _read(config_path)
    spec = processor_spec(config)
    block = config.get(spec.settings_block) if spec.settings_block is not None else None
    if isinstance(block, dict):
        vision = config.get("vision_config")
        stated, defaults = _model_block(
            block, vision if isinstance(vision, dict) else {}, fields, base, config_path
        )
        fields = {**defaults, **fields, **stated, "video_sampling": spec.video_sampling}
    try:
        return dataclasses.replace(base, **fields)
    except (TypeError, ValueError) as e:
        raise ProcessorConfigError(f"{root}: processor settings {fields}: {e}") from e


def _processor_files(root: Path, base: PreprocessConfig) -> dict[str, Any]:
    """The fields processor_config.json / preprocessor_config.json / video_preprocessor_config.json set."""
    combined = _read(root / "processor_config.json")
    image, image_file = combined.get("image_processor"), root / "processor_config.json"
    if not isinstance(image, dict):
        image, image_file = _read(root / "preprocessor_config.json"), root / "preprocessor_config.json"
    video, video_file = combined.get("video_processor"), root / "processor_config.json"
    if not isinstance(video, dict):
        video, video_file = (
            _read(root / "video_preprocessor_config.json"),
            root / "video_preprocessor_config.json",
        )
    fields: dict[str, Any] = {}
    with _naming(image_file):
        fields.update(_common(image))
        lo, hi = _pixel_bounds(image)
        if lo is not None:
            fields["min_pixels"] = lo
        if hi is not None:
            fields["max_pixels"] = hi
    with _naming(video_file):
        lo, hi = _pixel_bounds(video)
        if lo is not None:
            fields["video_min_pixels"] = lo
        if hi is not None:
            fields["video_max_pixels"] = hi
        for name, kind in (("fps", float), ("min_frames", int), ("max_frames", int)):
            if video.get(name) is not None:
                fields[name] = kind(video[name])
        if video.get("max_video_tokens") is not None:
            unit = fields.get("patch_size", base.patch_size) * fields.get("merge_size", base.merge_size)
            fields["video_total_pixels"] = int(int(video["max_video_tokens"]) * unit * unit * 0.9)
    return fields


# config.json processor_config key -> (PreprocessConfig field, type)
_BLOCK_FIELDS: dict[str, tuple[str, type]] = {
    "patch_size": ("patch_size", int),
    "merge_size": ("merge_size", int),
    "temporal_patch_size": ("temporal_patch_size", int),
    "image_min_pixels": ("min_pixels", int),
    "image_max_pixels": ("max_pixels", int),
    "video_min_pixels": ("video_min_pixels", int),
    "video_max_pixels": ("video_max_pixels", int),
    "video_total_max_pixels": ("video_total_pixels", int),
    "fps": ("fps", float),
    "max_frames": ("max_frames", int),
    "min_frames": ("min_frames", int),
}
# vision_config key -> PreprocessConfig field: the block's fallback for its patch geometry.
_VISION_FIELDS: dict[str, str] = {
    "patch_size": "patch_size",
    "spatial_merge_size": "merge_size",
    "temporal_patch_size": "temporal_patch_size",
}


def _model_block(
    block: dict[str, Any],
    vision: dict[str, Any],
    files: dict[str, Any],
    base: PreprocessConfig,
    path: Path,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(stated, defaults)`` of config.json's ``processor_config``: the fields it sets (level 1 of
    the module docstring's precedence) and its processor's defaults for those it leaves out
    (level 3)."""
    if block.get("num_frames") is not None:
        raise ProcessorConfigError(
            f"{path}: processor_config.num_frames={block['num_frames']!r} (a fixed frame count) is not "
            "supported; only fps sampling (num_frames: null) is"
        )
    ratio = block.get("temporal_compression_ratio")
    if ratio is not None and ratio != 1:
        raise ProcessorConfigError(
            f"{path}: processor_config.temporal_compression_ratio={ratio!r} is not supported (only 1)"
        )
    stated: dict[str, Any] = {}
    for key, (name, kind) in _BLOCK_FIELDS.items():
        value = block.get(key)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (kind is int and value != int(value))
        ):
            raise ProcessorConfigError(f"{path}: processor_config.{key} must be a number, got {value!r}")
        stated[name] = kind(value)
    defaults: dict[str, Any] = {}
    for key, name in _VISION_FIELDS.items():
        value = vision.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ProcessorConfigError(f"{path}: vision_config.{key} must be an integer, got {value!r}")
            defaults[name] = value

    def pick(name: str) -> Any:
        for layer in (stated, files, defaults):
            if name in layer:
                return layer[name]
        return getattr(base, name)

    f = pick("patch_size") * pick("merge_size")
    defaults.update(
        min_pixels=4 * f * f,
        max_pixels=4096 * f * f,
        video_min_pixels=4 * f * f,
        video_max_pixels=4096 * f * f,
        video_total_pixels=16384 * f * f,
        fps=2.0,
        max_frames=256,
        min_frames=8,
    )
    return stated, defaults


def _common(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("patch_size", "temporal_patch_size", "merge_size"):
        if d.get(name) is not None:
            out[name] = int(d[name])
    for name in ("image_mean", "image_std"):
        if d.get(name) is not None:
            values = tuple(float(x) for x in d[name])
            if len(values) != 3:
                raise ValueError(f"{name} must have 3 values, got {list(values)}")
            out[name] = values
    return out


def _pixel_bounds(d: dict[str, Any]) -> tuple[int | None, int | None]:
    raw_size = d.get("size")
    size: dict[str, Any] = raw_size if isinstance(raw_size, dict) else {}
    lo = d["min_pixels"] if d.get("min_pixels") is not None else size.get("shortest_edge")
    hi = d["max_pixels"] if d.get("max_pixels") is not None else size.get("longest_edge")
    return (None if lo is None else int(lo)), (None if hi is None else int(hi))


def _read(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; {} when there is no such file."""
    if not path.is_file():
        return {}
    try:
        return read_json_object(path)
    except CheckpointError as e:
        raise ProcessorConfigError(str(e)) from e


class _naming:
    """Re-raise a bad field's error with the file it came from."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, (TypeError, ValueError)) and not isinstance(exc, ProcessorConfigError):
            raise ProcessorConfigError(f"{self.path}: {exc}") from exc
