"""The ``epd`` command. Each subcommand lives in its own module; this file only dispatches."""

from __future__ import annotations

import argparse
import importlib
import sys

from epd.allocator import keep_freed_memory
from epd_common.child_process import arm_from_env
from epd_common.mkl_dispatch import use_mkl_avx512

# subcommand -> (module, help). Each module defines `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("epd.serve_cmd", "start ingress, encoder workers and the LLM engine on this machine"),
    "cache": ("epd.cache_cmd", "inspect and manage the node embedding cache"),
    "encoder": ("epd.encoder_cmd", "run encoder workers alone (POST /encode, GET /embeddings/{key})"),
    "bench": (
        "epd.bench_cmd",
        "run a benchmark against baselines (encoder: encode QPS and latency; from a source checkout)",
    ),
    "llm": ("epd.llm_cmd", "run the LLM engine role alone (OpenAI-compatible /v1/completions)"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or with ``only`` set, one whose other subcommands are listed but not
    imported (``epd cache stats`` need not import the model code of ``epd serve``)."""
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="epd", description="epd multimodal inference service"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        if only is None or name == only:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    arm_from_env()  # a supervised child stops with its parent (where no setpriv did that)
    keep_freed_memory()  # every role process starts here (the supervisor spawns `epd <role>`)
    use_mkl_avx512()  # before any role imports torch
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(only=command if command in SUBCOMMANDS else "").parse_args(argv)
    return int(args._run(args))


if __name__ == "__main__":
    sys.exit(main())
