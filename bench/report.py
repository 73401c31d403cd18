"""Turning load runs into the benchmark's outputs: one table row and one JSON record per run, and
a PNG with the latency CDF and the QPS over time of every run.

This module knows nothing of how the runs were produced."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from bench.common import percentiles
from bench.loadgen import LoadResult, qps_timeline

COLUMNS = [
    "service",
    "phase",
    "load",
    "ok",
    "errors",
    "QPS",
    "mean ms",
    "P50 ms",
    "P90 ms",
    "P99 ms",
    "hit rate",
    "CPU ms/req",
    "load 1m",
]


class Run(NamedTuple):
    """One measured run: which service, which phase (cold/hot/video), and its load result."""

    service: str  # "baseline" | "ours"
    phase: str  # "cold" | "hot" | "video" ...
    result: LoadResult
    # 1-minute load average before and after the run: the machine may be shared, so read
    # absolute numbers against it (ratios of runs with very different load are suspect).
    loadavg: tuple[float, float] = (float("nan"), float("nan"))
    # CPU seconds the service's processes spent during the run (None when not measurable).
    service_cpu_s: float | None = None
    # CPU seconds the benchmark process itself (load generator, media server) spent during the run.
    client_cpu_s: float | None = None

    @property
    def label(self) -> str:
        r = self.result
        load = f"closed c={int(r.level)}" if r.mode == "closed" else f"open {r.level:.2f}/s"
        return f"{self.service} {self.phase} {load}"


def record(run: Run) -> dict[str, Any]:
    """The JSON record of a run: counts, QPS, latency percentiles (ms), server stage medians."""
    r = run.result
    lat = r.latencies_s()
    pct = percentiles(lat) if lat else None
    hits = [o.cache_hit for o in r.ok if o.cache_hit is not None]
    stages: dict[str, float] = {}
    for name in sorted({k for o in r.ok for k in o.server_ms}):
        stages[name] = statistics.median(o.server_ms[name] for o in r.ok if name in o.server_ms)
    first_errors = sorted({o.error for o in r.outcomes if o.error})[:3]
    return {
        "service": run.service,
        "phase": run.phase,
        "mode": r.mode,
        "level": r.level,
        "requests": len(r.outcomes),
        "ok": len(r.ok),
        "errors": r.errors,
        "error_examples": first_errors,
        "wall_s": r.wall_s,
        "qps": r.qps,
        "latency_ms": {
            "mean": pct.mean * 1e3 if pct else None,
            "p50": pct.p50 * 1e3 if pct else None,
            "p90": pct.p90 * 1e3 if pct else None,
            "p99": pct.p99 * 1e3 if pct else None,
        },
        "cache_hit_rate": sum(hits) / len(hits) if hits else None,
        "loadavg_1m_before_after": list(run.loadavg),
        "service_cpu_s": run.service_cpu_s,
        "service_cpu_ms_per_request": (
            run.service_cpu_s / len(r.ok) * 1e3 if run.service_cpu_s is not None and r.ok else None
        ),
        "client_cpu_ms_per_request": (
            run.client_cpu_s / len(r.outcomes) * 1e3 if run.client_cpu_s is not None and r.outcomes else None
        ),
        "server_stage_median_ms": stages,
        "qps_timeline": qps_timeline(r),
    }


def table_row(rec: dict[str, Any]) -> list[object]:
    lat = rec["latency_ms"]
    nan = float("nan")
    hit = rec["cache_hit_rate"]
    return [
        rec["service"],
        rec["phase"],
        (f"closed c={int(rec['level'])}" if rec["mode"] == "closed" else f"open {rec['level']:.2f}/s"),
        rec["ok"],
        rec["errors"],
        rec["qps"],
        lat["mean"] if lat["mean"] is not None else nan,
        lat["p50"] if lat["p50"] is not None else nan,
        lat["p90"] if lat["p90"] is not None else nan,
        lat["p99"] if lat["p99"] is not None else nan,
        "-" if hit is None else f"{hit:.0%}",
        rec["service_cpu_ms_per_request"] if rec["service_cpu_ms_per_request"] is not None else nan,
        "{:.1f}->{:.1f}".format(*rec["loadavg_1m_before_after"]),
    ]


def stage_table(records: Sequence[dict[str, Any]]) -> tuple[list[str], list[list[object]]]:
    """Stage names seen in any record, and one row per record of its median stage times (ms)."""
    names = sorted({k for r in records for k in r["server_stage_median_ms"]})
    rows: list[list[object]] = []
    for r in records:
        stages = r["server_stage_median_ms"]
        if stages:
            label = f"{r['service']} {r['phase']} {r['mode']}"
            rows.append([label, *(stages.get(n, float("nan")) for n in names)])
    return names, rows


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None when either is missing or the denominator is 0."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def plot(runs: Sequence[Run], path: Path, title: str) -> Path:
    """Latency CDF (left) and successful answers per second over time (right), one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_cdf, ax_qps) = plt.subplots(1, 2, figsize=(13, 5))
    for run in runs:
        lat_ms = sorted(x * 1e3 for x in run.result.latencies_s())
        if lat_ms:
            ys = [(i + 1) / len(lat_ms) for i in range(len(lat_ms))]
            ax_cdf.step(lat_ms, ys, where="post", label=run.label)
        # Buckets of ~1/40 of the run (at least 1 s), so low rates do not plot as 0/1 spikes.
        timeline = qps_timeline(run.result, bucket_s=max(1.0, run.result.wall_s / 40))
        if timeline:
            ax_qps.plot([t for t, _ in timeline], [q for _, q in timeline], marker=".", label=run.label)
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("latency (ms, log scale)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("latency CDF")
    ax_cdf.grid(True, which="both", alpha=0.3)
    ax_cdf.legend(fontsize="small")
    ax_qps.set_xlabel("time since the run started (s)")
    ax_qps.set_ylabel("successful answers per second")
    ax_qps.set_title("QPS over time")
    ax_qps.grid(True, alpha=0.3)
    ax_qps.legend(fontsize="small")
    fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
