"""The one safetensors reader for every role: where each tensor of a checkpoint directory is
stored, and reading the ones a role asks for.

A directory keeps its weights in one of two layouts:

    model.safetensors.index.json   {"weight_map": {tensor name: file}}; a file may sit in a
                                   sub-folder ("vision/model-00001-of-00002.safetensors"), never
                                   outside the directory. The index chooses the files: only
                                   those listing a tensor a role asks for are opened (a
                                   vision tower's shards are never opened by the LLM); their
                                   headers say what they hold.
    *.safetensors                  without an index: every file at the top level (one
                                   ``model.safetensors``, or shards written without an index); the
                                   map comes from their headers, and a tensor in two files is an
                                   error.

Every problem raises ``CheckpointError`` naming the file and, where there is one, the tensor (a
file cut short names the first tensor whose bytes are missing).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from safetensors import safe_open
from torch import Tensor

from epd_common.checkpoint.config_json import read_json_object
from epd_common.checkpoint.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"


class TensorHeader(NamedTuple):
    """One tensor as its file's header describes it (nothing read)."""

    elements: int
    dtype: str  # safetensors' spelling: "F32", "BF16", "F8_E4M3", ...


@dataclass(frozen=True)
class ShardMap:
    """Where each tensor of ``root`` is stored: disk tensor name -> safetensors file."""

    root: Path
    files: Mapping[str, Path]
    index: Path | None  # the index file, or None for loose *.safetensors files

    def file_list(self, wanted: Callable[[str], bool] | None = None) -> list[Path]:
        """The files the map names for a tensor ``wanted`` accepts (every file without it), sorted."""
        return sorted({f for name, f in self.files.items() if wanted is None or wanted(name)})


def shard_map(model_dir: Path) -> ShardMap:
    """The tensor -> file map of ``model_dir`` (see the module docstring for the two layouts)."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        return ShardMap(root, _indexed(root, index), index)
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise CheckpointError(
            f"{root}: missing weights (neither model.safetensors nor model.safetensors.index.json, "
            "nor any *.safetensors file)"
        )
    files: dict[str, Path] = {}
    for path in found:
        for name in _header_names(path):
            if name in files:
                raise CheckpointError(
                    f"tensor {name!r} appears more than once in {root}: {files[name]}, {path}"
                )
            files[name] = path
    return ShardMap(root, files, None)


class TensorsRead(NamedTuple):
    tensors: dict[str, Tensor]  # disk name -> tensor
    files: dict[str, Path]  # disk name -> the file it was read from (for messages)


def read_tensors(shards: ShardMap, wanted: Callable[[str], bool]) -> TensorsRead:
    """Every tensor ``wanted`` accepts (by disk name), read through safetensors' memory map.

    The map chooses the files: only those listing a wanted tensor are opened. The files' own
    headers say what they hold (an index that lists a tensor its file lacks does not make it up: the
    caller's key check names it missing). A tensor held by two files is an error."""
    tensors: dict[str, Tensor] = {}
    files: dict[str, Path] = {}
    for path in shards.file_list(wanted):
        if not path.is_file():
            listed = sorted(n for n, f in shards.files.items() if f == path)
            where = f", listed in {shards.index.name}" if shards.index is not None else ""
            raise CheckpointError(
                f"{path}: missing weight file (holds {listed[0]} and {len(listed) - 1} more{where})"
            )
        name: str | None = None
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    if not wanted(name):
                        continue
                    if name in tensors:
                        raise CheckpointError(
                            f"tensor {name!r} appears more than once in {shards.root}: {files[name]}, {path}"
                        )
                    tensors[name] = handle.get_tensor(name)
                    files[name] = path
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            where = f" reading tensor {name!r}" if name is not None else ""
            raise CheckpointError(
                f"{path}: unreadable safetensors file{where} ({e}){_truncation(path)}"
            ) from e
    return TensorsRead(tensors, files)


def tensor_headers(shards: ShardMap) -> dict[str, TensorHeader]:
    """Every tensor in the map's files, from their headers (no tensor is read)."""
    out: dict[str, TensorHeader] = {}
    for path in shards.file_list():
        if not path.is_file():
            raise CheckpointError(f"{path}: missing weight file")
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    view = handle.get_slice(name)
                    elements = 1
                    for dim in view.get_shape():
                        elements *= int(dim)
                    out[name] = TensorHeader(elements, str(view.get_dtype()))
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{path}: unreadable safetensors file ({e}){_truncation(path)}") from e
    return out


def _indexed(root: Path, index: Path) -> dict[str, Path]:
    """The index's weight map, each file resolved below ``root``."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: not a safetensors index (no weight_map object)")
    inside = root.resolve()
    files: dict[str, Path] = {}
    resolved: dict[str, Path] = {}  # file as written -> path, checked once per file
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise CheckpointError(f"{index}: tensor {name!r} maps to {file!r}, not a file name")
        if file not in resolved:
            path = root / file
            if not path.resolve().is_relative_to(inside):
                raise CheckpointError(f"{index}: tensor {name!r} maps to {file!r}, outside {root}")
            resolved[file] = path
        files[str(name)] = resolved[file]
    return files


def _header_names(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys())
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path}: unreadable safetensors file ({e}){_truncation(path)}") from e


def _truncation(path: Path) -> str:
    """'; ...' naming the first tensor whose bytes lie past the end of ``path``, or '' when the file
    is not cut short (or its header cannot tell)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 + n:
                return f"; the file is truncated: {size} bytes, its header alone needs {8 + n}"
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return ""
    data = size - 8 - n
    cut = [
        (int(v["data_offsets"][1]), k)
        for k, v in header.items()
        if isinstance(v, dict) and "data_offsets" in v and int(v["data_offsets"][1]) > data
    ]
    if not cut:
        return ""
    end, name = min(cut)
    return f"; the file is truncated: tensor {name!r} needs {end} data bytes, the file holds {data}"
