"""Fixtures shared across the test packages: the tiny Qwen2.5-VL and MiMo-V2.5 checkpoints (each
built once per session, only when a test asks for it), a folder for the media the scenarios write,
and fp32 without TF32 for the CUDA parity tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.fixtures.mimo_v2 import write_tiny_mimo_v2
from tests.fixtures.mimo_v2_vllm import write_tiny_mimo_v2_vllm
from tests.fixtures.qwen2_5_vl import build_tiny_qwen2_5_vl


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Qwen2.5-VL checkpoint (``tests.fixtures.qwen2_5_vl``); tests must not change it."""
    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


@pytest.fixture(scope="session")
def mimo_v2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny MiMo-V2.5 checkpoint in the released layout, with its vision tower
    (``tests.fixtures.mimo_v2``); tests must not change it."""
    return write_tiny_mimo_v2(tmp_path_factory.mktemp("mimo_v2"))


@pytest.fixture(scope="session")
def mimo_v2_vllm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny MiMo-V2.5 checkpoint in the form vLLM's CPU build runs, embeddings only
    (``tests.fixtures.mimo_v2_vllm``); tests must not change it."""
    return write_tiny_mimo_v2_vllm(tmp_path_factory.mktemp("mimo_v2_vllm"))


@pytest.fixture(scope="session")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the scenarios write their media files (``scenario_messages``)."""
    return tmp_path_factory.mktemp("qwen_media")


@pytest.fixture
def no_tf32() -> Iterator[None]:
    """fp32 means fp32 on both sides for the duration of a test (CUDA matmuls default to TF32)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
