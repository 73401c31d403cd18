"""``epd serve``: placeholder until the service lands (see README, Status)."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)


def run(args: argparse.Namespace) -> int:
    print(
        "epd serve: the service is not built yet. Built so far: media_io (fetch, decode, video, "
        "preprocessing). Not yet: the ingress app, encoder workers, the LLM engine and the launcher.",
        file=sys.stderr,
    )
    return 2
