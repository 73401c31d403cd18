"""Environment variables, read in this one module. Every variable has the ``EPD_`` prefix."""

from __future__ import annotations

import os
from pathlib import Path


def epd_home() -> Path:
    """Where embedded default checkpoints and run state live (``EPD_HOME``, default ~/.cache/epd)."""
    return Path(os.environ.get("EPD_HOME", str(Path.home() / ".cache" / "epd")))


def env_str(name: str, default: str | None = None) -> str | None:
    assert name.startswith("EPD_"), name
    return os.environ.get(name, default)


def env_list(name: str) -> tuple[str, ...]:
    """A comma-separated list, e.g. EPD_ALLOW_HOSTS=media.local,10.0.0.0/8."""
    raw = env_str(name) or ""
    return tuple(part.strip() for part in raw.split(",") if part.strip())
