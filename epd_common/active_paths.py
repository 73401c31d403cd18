"""Which implementation of each hot step a process really runs, for start banners and /health.

Every fast path in epd has a slower stand-in (a C kernel missing or stale, Pillow instead of
Pillow-SIMD, DALI not installed, torch's sgemm not bound). The stand-ins give the same results, so
nothing but speed shows which one ran; these records make it visible.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class ActivePath(NamedTuple):
    """One step and what runs it."""

    step: str  # e.g. "jpeg_decode"
    impl: str  # what runs it, e.g. "libjpeg (media_io._jpeg)"
    fallback: str | None = None  # None on the fast path; else why the fast path is not running


def report(paths: Sequence[ActivePath]) -> dict[str, Any]:
    """``{"paths": {step: impl}, "fallbacks": ["step: why", ...]}`` (JSON-ready)."""
    return {
        "paths": {p.step: p.impl for p in paths},
        "fallbacks": [f"{p.step}: {p.fallback}" for p in paths if p.fallback is not None],
    }
