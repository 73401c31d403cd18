"""The optional C extensions: what each is built from, and loading one only if it matches its sources.

``setup.py`` builds every extension in ``EXTENSIONS`` with ``EPD_SOURCE_HASH`` defined as the hash
of the files listed here (its C sources and the headers it includes); the module exports it as
``SOURCE_HASH``. ``load`` imports an extension and compares that hash with the files in this tree:

    built       the hashes agree: the extension is what the sources say
    stale       they differ (a .so left from an older build, or sources edited since): not used,
                the caller takes its pure-Python path, and a warning says to rerun the install
    missing     no extension (no C compiler, no library headers): the pure-Python path
    unverified  the sources are not beside the package (an installed wheel): used as built

Every outcome is recorded (``statuses``) so a role can report which paths it really runs.
This module uses only the standard library: ``setup.py`` loads it from the file before any
package is installed.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

log = logging.getLogger("epd.native")

ROOT = Path(__file__).resolve().parents[1]  # the source tree (this file's package is top level)

_LLM_COMMON = ("llm_core/kernels/_kernels.h",)

# extension module -> the files it is compiled from (sources first, then the headers it includes)
EXTENSIONS: dict[str, tuple[str, ...]] = {
    "media_io.preprocess._patchify": ("media_io/preprocess/_patchify.c",),
    "media_io._jpeg": ("media_io/_jpeg.c",),
    "epd_common._mkl_cpu": ("epd_common/_mkl_cpu.c",),
    "llm_core.kernels._paged_attention": (
        "llm_core/kernels/_paged_attention.c",
        *_LLM_COMMON,
        "llm_core/kernels/_paged_attention.h",
    ),
    "llm_core.kernels._moe": (
        "llm_core/kernels/_moe.c",
        *_LLM_COMMON,
        "llm_core/kernels/_blas.h",
        "llm_core/kernels/_gemm.h",
        "llm_core/kernels/_moe.h",
    ),
    "llm_core.kernels._rms_norm": (
        "llm_core/kernels/_rms_norm.c",
        *_LLM_COMMON,
        "llm_core/kernels/_rms_norm.h",
    ),
    "llm_core.kernels._decoder_layer": (
        "llm_core/kernels/_decoder_layer.c",
        *_LLM_COMMON,
        "llm_core/kernels/_blas.h",
        "llm_core/kernels/_gemm.h",
        "llm_core/kernels/_paged_attention.h",
        "llm_core/kernels/_moe.h",
        "llm_core/kernels/_pool.h",
        "llm_core/kernels/_rms_norm.h",
    ),
}


class ExtensionStatus(NamedTuple):
    """How one extension was found at load time."""

    state: str  # "built" | "stale" | "missing" | "unverified"
    detail: str  # why, for a log line or /health


_statuses: dict[str, ExtensionStatus] = {}


def source_hash(name: str, root: Path | None = None) -> str | None:
    """sha256 (first 16 hex digits) over the files ``name`` is built from (under ``root``, default
    this tree), None if one is absent."""
    digest = hashlib.sha256()
    for rel in EXTENSIONS[name]:
        path = (ROOT if root is None else root) / rel
        if not path.is_file():
            return None
        digest.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def load(name: str) -> ModuleType | None:
    """The extension module ``name`` when it is built from the sources in this tree, else None.

    A stale build (its ``SOURCE_HASH`` differs from the sources') is not used: running it would
    give results from code that is no longer the code under test."""
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        _record(name, ExtensionStatus("missing", f"not built ({e})"))
        return None
    built = getattr(module, "SOURCE_HASH", None)
    expected = source_hash(name)
    if expected is None:
        _record(name, ExtensionStatus("unverified", "sources not present; used as installed"))
        return module
    if built != expected:
        status = ExtensionStatus(
            "stale",
            f"built from other sources (build {built or 'without a hash'}, sources {expected}): "
            "not used; rerun the install (make setup, or pip install -e .)",
        )
        _record(name, status)
        log.warning("C extension %s is %s", name, status.detail)
        return None
    _record(name, ExtensionStatus("built", f"source hash {expected}"))
    return module


def _record(name: str, status: ExtensionStatus) -> None:
    _statuses[name] = status


def statuses() -> dict[str, ExtensionStatus]:
    """Every extension loaded so far in this process, by module name."""
    return dict(_statuses)


def fallback_reason(name: str) -> str | None:
    """None when ``name`` loaded (built, or unverified), else why its pure-Python path runs."""
    status = _statuses.get(name)
    if status is None:
        return f"{name} was not loaded"
    if status.state in ("built", "unverified"):
        return None
    return f"{name} {status.state}: {status.detail}"


def unavailable_reason(name: str) -> str:
    """Why a wrapper runs without ``name``: the load's reason, or that it was not loaded (it loaded
    but the wrapper could not use it, or nothing imported it)."""
    return fallback_reason(name) or f"{name} was not loaded"
