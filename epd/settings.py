"""Environment variables, read in this one module. Every variable has the ``EPD_`` prefix.

Everything else is configured through the frozen config dataclasses and their CLI flags.
"""

from __future__ import annotations

import os
from pathlib import Path


def epd_home() -> Path:
    """Where embedded default checkpoints live (``EPD_HOME``, default ~/.cache/epd)."""
    return Path(os.environ.get("EPD_HOME", str(Path.home() / ".cache" / "epd")))
