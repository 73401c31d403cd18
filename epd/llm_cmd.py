"""``epd llm``: run the LLM engine role alone (flags map onto ``LLMServerConfig``)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from epd.config_cli import add_dataclass_args, add_model_dir_argument, dataclass_from_args, model_path_from
from epd_common.messages.embedding_reader import EmbeddingReader
from llm_core.serving.server_config import LLMServerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_args(parser, LLMServerConfig)
    add_model_dir_argument(parser, "its language model, tokenizer and chat template")


def run(args: argparse.Namespace) -> int:
    from llm_core.serving.server import serve_llm  # heavy import (torch, model) only when the command runs

    config = dataclass_from_args(LLMServerConfig, args)
    config = dataclasses.replace(config, model_path=model_path_from("llm", args.model_dir, config.model_path))
    serve_llm(config, open_embedding_cache, config.model_dir or default_llm_dir())
    return 0


def default_llm_dir() -> Path:
    """The embedded default's checkpoint, written on first use (weights, distilled MTP heads,
    tokenizer: ``llm_core.tools.default_llm``, tens of seconds once)."""
    from llm_core.tools.default_llm import ensure_default_checkpoint

    return ensure_default_checkpoint()


def open_embedding_cache(namespace: str) -> EmbeddingReader | None:
    """The engine reads this node's embedding cache, which the encoder owns: the engine package
    does not import the encoder, this command wires the two."""
    from encoder.caches.embed_cache import open_reader

    return open_reader(namespace, writer=f"llm:{namespace}")
