"""``epd bench``: the project's benchmarks from the command line, in a source checkout.

``epd bench encoder [flags]`` is ``python -m bench.encoder_qps [flags]``: the encode service
against the baseline, in one run (see that module for what is measured and how).

The benchmarks are not part of the installed product (the wheel has no ``bench`` package). This
command finds them in the source checkout this ``epd`` package was imported from: the repository
root (it holds ``pyproject.toml``) with the ``bench`` package beside ``epd``. Without one it says
so and exits 2. Nothing here imports ``bench`` at import time.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

EPD_DIR = Path(__file__).resolve().parent

# benchmark name -> (module in the checkout, help). Each module defines `add_arguments(parser)` and
# `run(args) -> int`.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "encoder": (
        "bench.encoder_qps",
        "encode QPS and latency: our service vs the baseline, cold and hot cache, video",
    ),
}

NO_CHECKOUT = (
    "the benchmarks ship with the source, not with the installed package: run `epd bench` from a "
    "source checkout of epd (git clone, then `make setup` or `pip install -e .`), or run "
    "`python -m bench.<name>` from its root"
)


def source_checkout(epd_dir: Path = EPD_DIR) -> Path | None:
    """The repository root that holds this ``epd`` package and the ``bench`` package, or None
    (an installed wheel: ``epd`` sits in site-packages with no ``bench`` or pyproject beside it)."""
    root = epd_dir.parent
    if (root / "bench" / "__init__.py").is_file() and (root / "pyproject.toml").is_file():
        return root
    return None


def import_benchmark(module_name: str, root: Path) -> ModuleType:
    """Import a benchmark module from the checkout at ``root``.

    The root goes first on ``sys.path`` (an editable install maps only the product packages) and on
    ``PYTHONPATH`` for the processes a benchmark starts (``python -m bench.baseline_server``)."""
    entry = str(root)
    if entry not in sys.path:
        sys.path.insert(0, entry)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if entry not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([entry, *paths])
    return importlib.import_module(module_name)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    root = source_checkout()
    if root is None:
        # No checkout: every argument is accepted so that any `epd bench ...` line gets the one
        # clear error from run() instead of argparse's complaint about unknown flags.
        parser.description = f"{parser.description or ''} ({NO_CHECKOUT})"
        parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        parser.set_defaults(_bench_run=_no_checkout)
        return
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, (module_name, help_text) in BENCHMARKS.items():
        module = import_benchmark(module_name, root)
        p = sub.add_parser(
            name,
            help=help_text,
            description=(module.__doc__ or "").split("\n", 1)[0],
            allow_abbrev=False,
        )
        module.add_arguments(p)
        p.set_defaults(_bench_run=module.run)


def _no_checkout(args: argparse.Namespace) -> int:
    print(f"epd bench: {NO_CHECKOUT}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args))
