"""``epd bench``: the project's benchmarks from the command line.

``epd bench encoder [flags]`` is ``python -m bench.encoder_qps [flags]``: the encode service
against the baseline, in one run (see that module for what is measured and how).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bench import encoder_qps

    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    p = sub.add_parser(
        "encoder",
        help="encode QPS and latency: our service vs the baseline, cold and hot cache, video",
        description=(encoder_qps.__doc__ or "").split("\n", 1)[0],
        allow_abbrev=False,
    )
    encoder_qps.add_arguments(p)
    p.set_defaults(_bench_run=encoder_qps.run)


def run(args: argparse.Namespace) -> int:
    return int(args._bench_run(args))
