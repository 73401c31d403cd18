"""media_paths: what decodes and preprocesses, and every stand-in named with its reason."""

from __future__ import annotations

import importlib.util

import pytest

import media_io.jpeg
import media_io.preprocess.patchify
from epd_common import native
from epd_common.active_paths import report
from media_io.active_paths import media_paths


def test_fast_paths_in_this_build() -> None:
    r = report(media_paths("cpu"))
    assert r["paths"]["preprocess_backend"] == "cpu"
    assert r["paths"]["jpeg_decode"].startswith("libjpeg")
    assert r["paths"]["patchify"].startswith("C kernel")
    assert r["paths"]["resize"].startswith("Pillow-SIMD")
    assert r["paths"]["dali"].startswith("nvidia-dali")
    assert r["fallbacks"] == []


def test_stand_ins_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(media_io.jpeg, "JPEG_KERNEL_AVAILABLE", False)
    monkeypatch.setattr(media_io.preprocess.patchify, "C_KERNEL_AVAILABLE", False)
    monkeypatch.setitem(native._statuses, "media_io._jpeg", native.ExtensionStatus("stale", "built from X"))
    r = report(media_paths("cpu"))
    assert r["paths"]["jpeg_decode"] == "Pillow" and r["paths"]["patchify"] == "numpy"
    assert r["fallbacks"] == [
        "jpeg_decode: media_io._jpeg stale: built from X",
        "patchify: media_io.preprocess._patchify was not loaded",  # loaded, yet unused: still named
    ]


def test_dali_backend_without_dali_is_a_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "nvidia.dali" else real(name)
    )
    assert report(media_paths("cpu"))["fallbacks"] == []  # the cpu backend does not need it
    assert report(media_paths("dali"))["fallbacks"] == ["dali: the dali backend needs nvidia-dali"]
