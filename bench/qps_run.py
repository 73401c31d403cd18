"""The steps of the encoder QPS benchmark (``bench.encoder_qps`` parses flags and calls
:func:`run_benchmark`): corpus, media server, ceiling, then each service's phases, then the table,
JSON and plot. See ``bench.encoder_qps`` for what is measured and why it is fair."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import report
from bench.ceiling import Ceiling, best_ceiling
from bench.common import format_machine, machine_info, print_table, write_json
from bench.loadgen import BodyFn, LoadResult, closed_loop, merge_results, new_session, open_loop
from bench.media_corpus import (
    DEFAULT_IMAGE_SIZES,
    QUICK_IMAGE_SIZES,
    CorpusItem,
    default_corpus_dir,
    image_corpus,
    unique_variant,
    video_corpus,
)
from bench.qps_summary import interleaved_ceiling, summarize
from bench.service_proc import ServiceProcess, free_port
from encoder.serving.worker import WorkerConfig, usable_cores
from tests.fixtures.media_server import MediaServer

ENCODE_PATH = "/v1/encode"


class Media:
    """The media server plus the request bodies of every phase.

    Cold phase ``tag`` request ``i`` fetches ``/m/{tag}-{i}.jpg``: base image ``order[i]`` with
    a nonce unique to this run, tag and index. Every service sees the same ``order``.
    """

    def __init__(self, server: Any, images: Sequence[CorpusItem], videos: Sequence[CorpusItem], seed: int):
        self.server = server
        self.images = list(images)
        self.videos = list(videos)
        self.run_id = uuid.uuid4().hex[:12]
        self.seed = seed

    def order(self, n: int, salt: int) -> list[int]:
        """``n`` base indices: every base once per cycle, each cycle shuffled (so the mix is uniform)."""
        rng = random.Random(self.seed * 1_000_003 + salt)
        out: list[int] = []
        while len(out) < n:
            cycle = list(range(len(self.images)))
            rng.shuffle(cycle)
            out.extend(cycle)
        return out[:n]

    def cold(self, tag: str, n: int, salt: int = 0, videos: bool = False) -> BodyFn:
        """Register ``n`` fresh-bytes variants under ``tag`` and return the body of request i."""
        base = self.videos if videos else self.images
        order = self.order(n, salt) if not videos else [i % len(base) for i in range(n)]
        urls = []
        for i, b in enumerate(order):
            item = base[b]
            ext = item.name.rsplit(".", 1)[-1]
            data = unique_variant(item.data, f"{self.run_id}-{tag}-{i}")
            urls.append(self.server.add(f"{tag}-{i}.{ext}", data, item.content_type))

        def body(i: int) -> dict[str, Any]:
            return {"items": [{"url": urls[i]}]}

        return body


class Progress:
    """A rich progress bar with one task per phase."""

    def __init__(self, enabled: bool) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(
            TextColumn("{task.description:<28}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            disable=not enabled,
            transient=False,
        )

    def task(self, description: str, total: int) -> Callable[[], None]:
        task_id = self.bar.add_task(description, total=total)
        return lambda: self.bar.advance(task_id)


async def _phase(
    endpoint: str,
    body: BodyFn,
    *,
    mode: str,
    level: float,
    requests: int,
    seed: int,
    progress: Progress,
    label: str,
) -> LoadResult:
    async with new_session() as session:
        on_done = progress.task(label, requests)
        if mode == "closed":
            return await closed_loop(
                session, endpoint, body, concurrency=int(level), requests=requests, on_done=on_done
            )
        return await open_loop(
            session, endpoint, body, rate=level, requests=requests, seed=seed, on_done=on_done
        )


def _check_ok(result: LoadResult, label: str) -> None:
    if result.errors:
        examples = sorted({o.error for o in result.outcomes if o.error})[:3]
        print(
            f"warning: {label}: {result.errors} of {len(result.outcomes)} requests failed: {examples}",
            file=sys.stderr,
        )


class Driver:
    """Runs load phases against one service and keeps their results (warm-up results are dropped)."""

    def __init__(
        self,
        service: str,
        base_url: str,
        media: Media,
        args: argparse.Namespace,
        progress: Progress,
        cpu_seconds: Callable[[], float | None] = lambda: None,
    ):
        self.service = service
        self.endpoint = base_url + ENCODE_PATH
        self.media = media
        self.args = args
        self.progress = progress
        # The service's process-tree CPU time (None for a service given by URL): CPU per request
        # is what background load on a shared machine distorts least.
        self.cpu_seconds = cpu_seconds

    def go(self, phase: str, body: BodyFn, mode: str, level: float, n: int, kind: str = "cold") -> report.Run:
        label = f"{self.service} {phase} {mode}"
        load_before = os.getloadavg()[0]
        cpu_before = self.cpu_seconds()
        client_before = time.process_time()  # this process: load generator + media server
        result = asyncio.run(
            _phase(
                self.endpoint,
                body,
                mode=mode,
                level=level,
                requests=n,
                seed=self.args.seed,
                progress=self.progress,
                label=label,
            )
        )
        _check_ok(result, label)
        client = time.process_time() - client_before
        cpu_after = self.cpu_seconds()
        cpu = cpu_after - cpu_before if cpu_before is not None and cpu_after is not None else None
        return report.Run(self.service, kind, result, (load_before, os.getloadavg()[0]), cpu, client)

    def warm_up(self) -> None:
        """Untimed requests with their own fresh bytes: model pages, pools, connections."""
        a = self.args
        if a.warmup:
            warm = self.media.cold(f"{self.service}-warm", a.warmup, salt=99)
            self.go("warm-up", warm, "closed", a.concurrency, a.warmup)

    def cold_chunk(self, r: int, n: int) -> tuple[report.Run, BodyFn]:
        """Round ``r`` of the cold closed loop: the same base images, in the same order, for every service."""
        body = self.media.cold(f"{self.service}-cold{r}", n, salt=1 + 1000 * r)
        return self.go(f"cold {r + 1}", body, "closed", self.args.concurrency, n), body


def interleaved_cold(
    drivers: Sequence[Driver],
    requests: int,
    rounds: int,
    before_round: Callable[[int], object] | None = None,
) -> list[tuple[report.Run, BodyFn]]:
    """The headline cold closed loop, split into ``rounds`` rounds that alternate between services.

    On a shared machine the background load drifts over minutes; alternating A B A B ... spreads
    that drift over both services instead of handing one of them a quiet (or busy) stretch.
    ``before_round(r)`` runs before each round (the forward-only ceiling, so that it sees the same
    drift). Returns per driver its merged run and a body function over all the rounds' requests
    (for the hot phase, which replays them).
    """
    rounds = max(1, min(rounds, requests))
    sizes = [requests // rounds + (1 if r < requests % rounds else 0) for r in range(rounds)]
    parts: list[list[tuple[report.Run, BodyFn]]] = [[] for _ in drivers]
    for r, n in enumerate(sizes):
        if before_round is not None:
            before_round(r)
        for d, drv in enumerate(drivers):
            parts[d].append(drv.cold_chunk(r, n))
    out: list[tuple[report.Run, BodyFn]] = []
    for drv, chunks in zip(drivers, parts, strict=True):
        merged = merge_results([run.result for run, _ in chunks])
        loads = (chunks[0][0].loadavg[0], chunks[-1][0].loadavg[1])
        bodies = [b for _, b in chunks]

        def body(i: int, bodies: list[BodyFn] = bodies) -> dict[str, Any]:
            r = 0
            while i >= sizes[r]:
                i -= sizes[r]
                r += 1
            return bodies[r](i)

        cpus = [run.service_cpu_s for run, _ in chunks]
        cpu = None if any(c is None for c in cpus) else sum(c for c in cpus if c is not None)
        client = sum(run.client_cpu_s or 0.0 for run, _ in chunks)
        out.append((report.Run(drv.service, "cold", merged, loads, cpu, client), body))
    return out


def rest_phases(
    drv: Driver,
    cold: report.Run,
    cold_body: BodyFn,
    open_rate: Callable[[LoadResult], float] | None,
    hot: bool,
    videos: bool,
) -> list[report.Run]:
    """Hot replay of the cold requests (node-cache hits), the open loop, and the video row."""
    a, runs = drv.args, []
    n_cold = len(cold.result.outcomes)
    if hot:
        runs.append(drv.go("hot", cold_body, "closed", a.concurrency, n_cold, kind="hot"))
    if open_rate is not None:
        body = drv.media.cold(f"{drv.service}-open", a.requests, salt=2)
        runs.append(drv.go("open", body, "open", open_rate(cold.result), a.requests))
    if videos and drv.media.videos and a.video_requests:
        body = drv.media.cold(f"{drv.service}-video", a.video_requests, videos=True)
        conc = min(a.concurrency, a.video_requests)
        runs.append(drv.go("video", body, "closed", conc, a.video_requests, kind="video"))
    return runs


def _started(procs: list[ServiceProcess], proc: ServiceProcess) -> ServiceProcess:
    procs.append(proc)  # appended first: a failed start is still stopped by the caller
    return proc.start()


def _baseline_process(log_dir: Path, model: Path | None) -> ServiceProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "bench.baseline_server", "--port", str(port)]
    cmd += ["--model", str(model)] if model is not None else []
    return ServiceProcess(
        "baseline", cmd, f"http://127.0.0.1:{port}", log_dir / "baseline.log", ready_path="/health"
    )


def _ours_process(log_dir: Path, namespace: str, extra: Sequence[str], model: Path | None) -> ServiceProcess:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "epd.cli",
        "serve",
        "--port",
        str(port),
        "--fetch-allow-hosts",
        "127.0.0.1",
        "--cache-namespace",
        namespace,
        "--no-llm",  # the benchmark measures encode; an idle engine would only take CPU
        *(["--encoder-model", str(model)] if model is not None else []),
        *extra,
    ]
    return ServiceProcess("epd serve", cmd, f"http://127.0.0.1:{port}", log_dir / "epd-serve.log")


def run_benchmark(args: argparse.Namespace) -> int:
    """Every step of the benchmark for already-parsed (and --quick-adjusted) flags."""
    machine = machine_info()
    if not sys.stdout.isatty():
        # rich wraps tables at 80 columns when piped; the results table needs ~130 to stay readable.
        os.environ.setdefault("COLUMNS", "160")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="epd-bench-logs-"))
    corpus_dir = args.corpus_dir or default_corpus_dir()
    t_corpus = time.perf_counter()
    images = image_corpus(
        corpus_dir, QUICK_IMAGE_SIZES if args.quick else DEFAULT_IMAGE_SIZES, seed=args.seed
    )
    videos = (
        video_corpus(corpus_dir, args.video_clips, seconds=args.video_seconds)
        if args.video_clips and args.video_requests
        else []
    )
    print(
        f"corpus: {len(images)} images, {len(videos)} clips in {corpus_dir} ({time.perf_counter() - t_corpus:.1f} s)"
    )

    budget = args.patch_budget or WorkerConfig(device="cpu").batch_budget()

    def measure_ceiling(when: str) -> list[Ceiling]:
        if args.no_ceiling:
            return []
        runs = best_ceiling(
            [it.data for it in images],
            cores=usable_cores(),
            patch_budget=budget,
            min_seconds=args.ceiling_seconds,
            model_path=str(args.encoder_model) if args.encoder_model else None,
        )
        for c in runs:
            print(
                f"forward-only ceiling ({when}, {c.label}): {c.images_per_s:.2f} images/s "
                f"({c.patches_per_s:,.0f} patches/s)"
            )
        return runs

    # Measured before every cold round and after the last phase, each way of using the cores. On
    # a shared machine the load drifts: the ceiling is the mean over these points of the better
    # way (the same drift the rounds saw); the fraction against the single best point is a lower
    # bound, reported beside it.
    points: list[list[Ceiling]] = []

    def ceiling_point(when: str) -> None:
        runs = measure_ceiling(when)
        if runs:
            points.append(runs)

    runs: list[report.Run] = []
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    progress = Progress(enabled=sys.stderr.isatty() or sys.stdout.isatty())
    with MediaServer(latency_s=args.latency_ms / 1e3) as server, progress.bar:
        media = Media(server, images, videos, args.seed)
        # One offered rate for both services: --rate, else 80% of the first service's cold QPS.
        rate: list[float] = [args.rate] if args.rate else []

        def open_rate(cold: LoadResult) -> float:
            if not rate:
                rate.append(max(0.8 * cold.qps, 0.1))
            return rate[0]

        open_fn = None if args.no_open else open_rate
        procs: list[ServiceProcess] = []
        try:
            drivers: list[Driver] = []
            if not args.no_baseline:
                if args.baseline_url:
                    drivers.append(Driver("baseline", args.baseline_url, media, args, progress))
                else:
                    base = _started(procs, _baseline_process(log_dir, args.encoder_model))
                    drivers.append(Driver("baseline", base.base_url, media, args, progress, base.cpu_seconds))
            if args.url:
                drivers.append(Driver("ours", args.url, media, args, progress))
            else:
                mine = _started(procs, _ours_process(log_dir, namespace, args.serve_arg, args.encoder_model))
                drivers.append(Driver("ours", mine.base_url, media, args, progress, mine.cpu_seconds))
            for drv in drivers:
                drv.warm_up()
            colds = interleaved_cold(
                drivers,
                args.requests,
                args.rounds,
                before_round=lambda r: ceiling_point(f"before round {r + 1}"),
            )
            for drv, (cold, body) in zip(drivers, colds, strict=True):
                ours = drv.service == "ours"
                runs += [cold, *rest_phases(drv, cold, body, open_fn, hot=ours, videos=ours)]
        finally:
            for proc in reversed(procs):
                proc.stop()
            shutil.rmtree(f"/dev/shm/epd-{namespace}", ignore_errors=True)

    ceiling_point("after")
    ceiling = interleaved_ceiling(points)
    records = [report.record(r) for r in runs]
    summary = summarize(records, ceiling)
    # a forward's share of a baseline request: the forward-only time per image over the baseline's
    # time per request (it serves one request at a time)
    summary["forward_fraction"] = report.ratio(summary["baseline_qps"], summary["ceiling_images_per_s"])
    if args.pipeline_bound:
        summary["pipeline_bound"] = True
        summary["targets_met"] = {
            "qps_ratio>=2": summary["qps_ratio"] is not None and summary["qps_ratio"] >= 2.0,
            "p90_ratio<=0.82": summary["p90_ratio"] is not None and summary["p90_ratio"] <= 0.82,
            "forward_fraction<=0.2": summary["forward_fraction"] is not None
            and summary["forward_fraction"] <= 0.2,
        }
    if points:
        best = max((c for runs_at in points for c in runs_at), key=lambda c: c.images_per_s)
        summary["ceiling_best_point_images_per_s"] = best.images_per_s
        summary["ceiling_fraction_vs_best_point"] = report.ratio(summary["ours_qps"], best.images_per_s)
        summary["ceiling_points"] = [
            {c.label: round(c.images_per_s, 3) for c in runs_at} for runs_at in points
        ]
    caption = format_machine(machine) + f" | media latency {args.latency_ms:g} ms"
    print_table(
        "encoder QPS (images 448x448..1920x1080; video: 1-minute clips)",
        report.COLUMNS,
        [report.table_row(r) for r in records],
        caption=caption,
    )
    stage_names, stage_rows = report.stage_table(records)
    if stage_rows:
        print_table("where the time goes: server-side stage medians (ms)", ["run", *stage_names], stage_rows)
    ratio_rows = [
        [k, v]
        for k, v in summary.items()
        if k != "targets_met" and v is not None and not isinstance(v, list | dict)
    ]
    print_table("summary", ["metric", "value"], ratio_rows)
    png = args.png or (args.json.with_suffix(".png") if args.json else None)
    if png is not None:
        report.plot(runs, png, caption)
        print(f"plot: {png}")
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    write_json(args.json, machine=machine, config=config, results=records, summary=summary)
    if args.json:
        print(f"json: {args.json}")
    return 0 if summary["errors"] == 0 else 1
