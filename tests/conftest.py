"""Fixtures shared across the test packages: the tiny Qwen2.5-VL checkpoint (built once per session,
only when a test asks for it) and a folder for the media its scenarios write."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.qwen2_5_vl import build_tiny_qwen2_5_vl


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen2.5-VL checkpoint (``tests.fixtures.qwen2_5_vl``); tests must not change it."""
    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the scenarios write their media files (``scenario_messages``)."""
    return tmp_path_factory.mktemp("qwen_media")
