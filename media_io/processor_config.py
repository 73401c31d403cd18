"""``PreprocessConfig`` from a checkpoint directory's processor files, as transformers reads them.

    processor_config.json       {"image_processor": {...}, "video_processor": {...}} (transformers 5)
    preprocessor_config.json    the image processor (every release), used when the above has none
    video_preprocessor_config.json   the video processor, likewise

Image fields: ``patch_size``, ``temporal_patch_size``, ``merge_size``, ``image_mean``,
``image_std``, and the pixel bounds as ``size.shortest_edge`` / ``size.longest_edge`` (what the
processors use) or ``min_pixels`` / ``max_pixels`` (what released configs also write; these win
when both are there, as transformers' image processor lets them override ``size``). Video fields: ``fps``, ``min_frames``,
``max_frames``, the per-frame pixel bounds the same way, and ``max_video_tokens`` (the total pixel
budget is 90% of it, in 28x28 units, as the video processor caps frames). Absent fields keep
``base``'s values. The result is what enters every MediaKey, so a checkpoint with other settings
never shares cached embeddings with this one.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from media_io.config import PreprocessConfig


class ProcessorConfigError(ValueError):
    """A processor file that cannot be read or holds a bad value; names the file and field."""


def preprocess_config_from_dir(
    model_dir: str | Path, base: PreprocessConfig = PreprocessConfig()
) -> PreprocessConfig:
    """``base`` updated with the processor settings found in ``model_dir`` (none: ``base``)."""
    root = Path(model_dir)
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
    try:
        return dataclasses.replace(base, **fields)
    except (TypeError, ValueError) as e:
        raise ProcessorConfigError(f"{root}: processor settings {fields}: {e}") from e


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
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ProcessorConfigError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ProcessorConfigError(f"{path}: not a JSON object")
    return raw


class _naming:
    """Re-raise a bad field's error with the file it came from."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, (TypeError, ValueError)) and not isinstance(exc, ProcessorConfigError):
            raise ProcessorConfigError(f"{self.path}: {exc}") from exc
