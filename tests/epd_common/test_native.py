"""The C extensions load only when built from this tree's sources; anything else is reported."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from epd_common import native

# Importing the wrappers loads every extension through native.load.
import llm_core.backends.selector  # noqa: F401  # isort: skip  (cpu_layer, cpu_attention, cpu_moe, cpu_norm)
import media_io.active_paths  # isort: skip
import media_io.jpeg  # isort: skip
import media_io.preprocess.patchify  # noqa: F401  # isort: skip


@pytest.fixture
def restore_statuses() -> Iterator[None]:
    """Tests below overwrite load records; reload the real ones afterwards."""
    yield
    for name in native.EXTENSIONS:
        native.load(name)


def test_every_extension_is_built_from_this_tree() -> None:
    statuses = native.statuses()
    assert set(native.EXTENSIONS) <= set(statuses)
    for name in native.EXTENSIONS:
        assert statuses[name].state == "built", (name, statuses[name])
        assert native.fallback_reason(name) is None


def test_source_hash_covers_every_listed_file(tmp_path: Path) -> None:
    name = "llm_core.kernels._rms_norm"
    for rel in native.EXTENSIONS[name]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(native.ROOT / rel, tmp_path / rel)
    assert native.source_hash(name, tmp_path) == native.source_hash(name)
    for rel in native.EXTENSIONS[name]:  # a change to the source or to any header it includes
        original = (tmp_path / rel).read_bytes()
        (tmp_path / rel).write_bytes(original + b"\n")
        assert native.source_hash(name, tmp_path) != native.source_hash(name), rel
        (tmp_path / rel).write_bytes(original)
    (tmp_path / native.EXTENSIONS[name][-1]).unlink()
    assert native.source_hash(name, tmp_path) is None


@pytest.mark.usefixtures("restore_statuses")
def test_a_stale_build_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The built .so against sources edited since: not loaded, and the reason says to rebuild."""
    name = "media_io._jpeg"
    for rel in native.EXTENSIONS[name]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes((native.ROOT / rel).read_bytes() + b"/* edited */\n")
    monkeypatch.setattr(native, "ROOT", tmp_path)
    assert native.load(name) is None
    status = native.statuses()[name]
    assert status.state == "stale" and "rerun the install" in status.detail
    reason = native.fallback_reason(name)
    assert reason is not None and reason.startswith("media_io._jpeg stale")


@pytest.mark.usefixtures("restore_statuses")
def test_sources_absent_means_unverified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "ROOT", tmp_path)  # an installed wheel: no sources beside it
    assert native.load("llm_core.kernels._moe") is not None
    assert native.statuses()["llm_core.kernels._moe"].state == "unverified"
    assert native.fallback_reason("llm_core.kernels._moe") is None


def test_missing_extension() -> None:
    assert native.load("media_io._no_such_kernel") is None
    assert native.statuses()["media_io._no_such_kernel"].state == "missing"
    reason = native.fallback_reason("media_io._no_such_kernel")
    assert reason is not None and "not built" in reason
