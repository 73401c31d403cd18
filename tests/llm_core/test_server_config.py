"""LLMServerConfig: the engine process's thread count from the command line, and its check."""

from __future__ import annotations

import argparse

import pytest

from epd.config_cli import add_dataclass_args, dataclass_from_args
from llm_core.server_config import LLMServerConfig


def test_torch_threads_flag() -> None:
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, LLMServerConfig)
    assert dataclass_from_args(LLMServerConfig, parser.parse_args([])).torch_threads is None
    config = dataclass_from_args(LLMServerConfig, parser.parse_args(["--torch-threads", "3"]))
    assert config.torch_threads == 3


def test_torch_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="torch_threads"):
        LLMServerConfig(torch_threads=0)
