"""The one reader of a checkpoint's JSON files: ``config.json`` for every role, and the processor
files (``media_io.processor_config``) through ``read_json_object``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from epd_common.checkpoint.errors import CheckpointError

CONFIG_FILE = "config.json"


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ``CheckpointError`` naming the file when it is unreadable, not
    JSON or not an object (a missing file too: callers that allow one check first)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return raw


def read_config_json(model_dir: Path) -> dict[str, Any]:
    """``model_dir/config.json`` as a dict; ``CheckpointError`` naming the file otherwise."""
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"missing config.json: {path} not found")
    return read_json_object(path)
