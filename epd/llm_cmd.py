"""``epd llm``: run the LLM engine role alone (flags map onto ``LLMServerConfig``)."""

from __future__ import annotations

import argparse
import dataclasses

from epd.config_cli import add_dataclass_args, dataclass_from_args
from llm_core.server_config import LLMServerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, LLMServerConfig)
    parser.add_argument(
        "--model",
        dest="model_dir",
        metavar="DIR",
        help="a Hugging Face checkpoint directory: its language model, tokenizer and chat template",
    )


def run(args: argparse.Namespace) -> int:
    from llm_core.server import serve_llm  # heavy import (torch, model) only when the command runs

    config = dataclass_from_args(LLMServerConfig, args)
    if args.model_dir:
        if config.model_path:
            raise SystemExit("epd llm: give --model or --model-path, not both")
        config = dataclasses.replace(config, model_path=args.model_dir)
    serve_llm(config)
    return 0
