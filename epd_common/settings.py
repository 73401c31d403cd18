"""Environment variables, read in this one module. Every variable has the ``EPD_`` prefix.

Everything else is configured through the frozen config dataclasses and their CLI flags.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any


def epd_home() -> Path:
    """Where embedded default checkpoints live (``EPD_HOME``, default ~/.cache/epd)."""
    return Path(os.environ.get("EPD_HOME", str(Path.home() / ".cache" / "epd")))


def default_checkpoint_dir(root: Path | None, kind: str, recipe: Any) -> Path:
    """``root/<kind>-<hash>``: where the embedded default generated from ``recipe`` lives.

    ``recipe`` is everything the generated weights depend on (config dataclass, seed, a version
    of the generator), so a changed default gets a directory of its own and a checkpoint built
    by an older release is never loaded in its place. ``root`` defaults to ``epd_home()``.
    """
    blob = json.dumps(_jsonable(recipe), sort_keys=True).encode()
    return (root or epd_home()) / f"{kind}-{hashlib.sha256(blob).hexdigest()[:12]}"


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {type(value).__name__: _jsonable(dataclasses.asdict(value))}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value if isinstance(value, str | int | float | bool | None) else repr(value)
