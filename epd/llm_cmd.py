"""``epd llm``: run the LLM engine role alone (flags map onto ``LLMServerConfig``)."""

from __future__ import annotations

import argparse

from epd.config_cli import add_dataclass_args, dataclass_from_args
from llm_core.server_config import LLMServerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, LLMServerConfig)


def run(args: argparse.Namespace) -> int:
    from llm_core.server import serve_llm  # heavy import (torch, model) only when the command runs

    serve_llm(dataclass_from_args(LLMServerConfig, args))
    return 0
