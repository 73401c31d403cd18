"""Encoder QPS benchmark: our encode service against the "before" baseline, in one run.

    python -m bench.encoder_qps [--quick] [--json PATH] [--png PATH] [--url URL] ...
    epd bench encoder ...                   (the same flags)

What one run does (only one service is under load at any moment, so neither steals the other's
CPU; the headline cold closed loop alternates between them in ``--rounds`` rounds so that drifting
background load on a shared machine hits both alike):

    corpus      JPEGs 448x448 .. 1920x1080 (+ 1-minute H.264 clips), generated once and cached
    media       a loopback media server serves them with added latency (default 30 ms, like an
                object store); cold requests get fresh bytes per request (bench.media_corpus)
    ceiling     forward-only images/s of the same encoder on the same images (bench.ceiling),
                both ways of using the cores (1 forward x all threads, one 1-thread forward per
                core), measured before every cold round and after the last phase
    baseline    bench.baseline_server as a subprocess: warm-up, cold closed loop, open loop
    ours        `epd serve` as a subprocess (or --url): warm-up, cold closed loop, hot closed
                loop (the cold URLs again: node-cache hits), open loop, video

Both services get the same request sequence (same base images in the same order, same
concurrency, same Poisson schedule), the same encoder checkpoint (the embedded default) and the
same client. The open-loop rate defaults to 80% of the baseline's closed-loop QPS, a load both
should sustain, so latencies compare at equal offered load.

Summary: ``qps_ratio`` (ours / baseline, cold closed loop), ``p90_ratio`` (ours / baseline P90,
same runs; < 1 is better), ``ceiling_fraction`` (our cold QPS / the mean over measurement points of
each point's better forward-only rate; ``ceiling_fraction_vs_best_point`` uses the single best
point instead, a lower bound). ``ceiling_over_baseline_qps`` is the most any pipeline around this
forward could reach as ``qps_ratio`` on this machine. On a shared machine wall rates drift with
the neighbours' load, CPU time much less: ``*_cpu_ms_per_request`` is each service's process-tree
CPU per request, ``ceiling_cpu_ms_per_image`` the forward alone, ``cpu_fraction`` their ratio for
ours, and ``client_cpu_ms_per_request`` what the load generator and media server cost.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import add_common_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_args(parser)
    g = parser.add_argument_group("services")
    g.add_argument("--url", default=None, help="a running service to measure (default: start `epd serve`)")
    g.add_argument("--baseline-url", default=None, help="a running baseline (default: start one)")
    g.add_argument("--no-baseline", action="store_true", help="measure our service only")
    g.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the `epd serve` we start (repeatable, e.g. --serve-arg=--encoder-workers=2)",
    )
    g.add_argument("--log-dir", type=Path, default=None, help="service logs (default: a temp dir)")
    g = parser.add_argument_group("load")
    g.add_argument("--concurrency", type=int, default=8, help="closed-loop concurrency")
    g.add_argument("--requests", type=int, default=120, help="requests per image phase")
    g.add_argument(
        "--rounds", type=int, default=4, help="cold closed loop in this many rounds alternating services"
    )
    g.add_argument("--warmup", type=int, default=8, help="untimed requests before each service's phases")
    g.add_argument("--rate", type=float, default=None, help="open-loop rate/s (default 0.8x baseline QPS)")
    g.add_argument("--no-open", action="store_true", help="skip the open-loop Poisson phase")
    g.add_argument("--latency-ms", type=float, default=30.0, help="added media-server latency")
    g = parser.add_argument_group("media")
    g.add_argument("--corpus-dir", type=Path, default=None, help="generated media cache")
    g.add_argument("--video-clips", type=int, default=2, help="distinct 1-minute clips (0: no video row)")
    g.add_argument("--video-requests", type=int, default=6, help="requests in the video row")
    g.add_argument("--video-seconds", type=float, default=60.0)
    g = parser.add_argument_group("outputs")
    g.add_argument("--png", type=Path, default=None, help="plot path (default: next to --json, else none)")
    g.add_argument(
        "--patch-budget",
        type=int,
        default=None,
        help="batch packing for the ceiling (default: the encoder worker's CPU budget)",
    )
    g.add_argument("--ceiling-seconds", type=float, default=3.0)
    g.add_argument("--no-ceiling", action="store_true")


def _quick(args: argparse.Namespace) -> None:
    """A smoke run's sizes: seconds, not meaningful numbers."""
    args.requests = min(args.requests, 6)
    args.rounds = min(args.rounds, 2)
    args.warmup = min(args.warmup, 1)
    args.concurrency = min(args.concurrency, 2)
    args.video_clips = min(args.video_clips, 1)
    args.video_requests = min(args.video_requests, 1)
    args.video_seconds = min(args.video_seconds, 2.0)
    args.ceiling_seconds = min(args.ceiling_seconds, 0.3)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``args`` (see :func:`add_arguments`); 0 when no request failed."""
    from bench.qps_run import run_benchmark  # torch, aiohttp, the corpus: only when actually running

    if args.quick:
        _quick(args)
    return run_benchmark(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, prog="python -m bench.encoder_qps", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
