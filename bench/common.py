"""Shared helpers for every benchmark in ``bench/``.

A benchmark here compares a candidate against a baseline measured *in the same run* on the same
machine, prints a table, and (with ``--json PATH``) writes a JSON file whose top level holds
``machine``, ``config``, ``results`` and a ``summary`` object with the headline ratios.

Typical use::

    from bench.common import add_common_args, machine_info, percentiles, print_table, write_json

    parser = argparse.ArgumentParser(allow_abbrev=False, description="...")
    add_common_args(parser)                     # --json PATH, --quick, --seed
    args = parser.parse_args()
    lat = timed_runs(lambda: work(), repeats=20)    # seconds per call
    p = percentiles(lat)                        # Percentiles(p50=..., p90=..., p99=..., mean=...)
    print_table("title", ["case", "P50 ms"], [["a", p.p50 * 1e3]])
    write_json(args.json, machine=machine_info(), config=vars(args), results=rows, summary={...})

This module knows nothing of what is measured; it only times, summarises and reports.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple


class Percentiles(NamedTuple):
    """Latency (or any sample) summary; same unit as the samples."""

    p50: float
    p90: float
    p99: float
    mean: float
    n: int


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default)."""
    if not samples:
        raise ValueError("percentile of an empty sample")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(samples)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentiles(samples: Sequence[float]) -> Percentiles:
    """P50/P90/P99 and the mean of ``samples``."""
    return Percentiles(
        p50=percentile(samples, 50),
        p90=percentile(samples, 90),
        p99=percentile(samples, 99),
        mean=sum(samples) / len(samples),
        n=len(samples),
    )


def timed_runs(fn: Callable[[], object], repeats: int, warmup: int = 1) -> list[float]:
    """Call ``fn`` ``warmup`` times untimed, then ``repeats`` times; seconds per call.

    Callers that time GPU work must synchronize inside ``fn``.
    """
    for _ in range(warmup):
        fn()
    out: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _busy_jiffies() -> tuple[int, int]:
    """(busy, total) CPU time of the whole machine so far (/proc/stat's first line)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def wait_for_quiet_cpu(busy_below: float = 0.05, window_s: float = 0.25, timeout_s: float = 10.0) -> float:
    """Wait until the machine's CPUs were busy less than ``busy_below`` of the time over a whole
    ``window_s`` (at most ``timeout_s``); returns the seconds waited. Between the sides of an
    interleaved benchmark: a server keeps working after its last answer (vLLM's CPU build kept a
    core busy for ~1 s after a closed-loop wave), and the side driven next would start on a core
    short. Where /proc/stat is missing it returns at once."""
    start = time.monotonic()
    try:
        last = _busy_jiffies()
        while time.monotonic() - start < timeout_s:
            time.sleep(window_s)
            now = _busy_jiffies()
            busy, total = now[0] - last[0], now[1] - last[1]
            if total > 0 and busy / total < busy_below:
                break
            last = now
    except OSError:
        pass
    return time.monotonic() - start


def machine_info() -> dict[str, Any]:
    """CPU model, usable cores, torch threads and the GPU (if any): print it with every result."""
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_cores": usable_cores(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
        else:
            info["gpu"] = None
    except ImportError:  # pragma: no cover - torch is a hard dependency of the project
        info["torch"] = None
    return info


def format_machine(info: dict[str, Any]) -> str:
    """One line describing the machine, for the header of a printed table."""
    gpu = info.get("gpu") or "no GPU"
    return (
        f"{info['cpu_model']} | {info['cpu_cores']} cores | torch {info.get('torch')} "
        f"({info.get('torch_threads')} threads) | {gpu}"
    )


def _fmt(v: object) -> str:
    if isinstance(v, float):
        if v == 0.0 or math.isnan(v):
            return f"{v}"
        if abs(v) >= 100:
            return f"{v:,.1f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    return str(v)


def print_table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[object]], caption: str = ""
) -> None:
    """Print a table with rich (numbers right-aligned, floats rounded for reading).

    ``caption`` (e.g. ``format_machine(machine_info())``) is printed unwrapped below the table.
    """
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*(_fmt(v) for v in r))
    console = Console()
    if not console.is_terminal:  # piped to a file or CI log: do not squeeze columns into 80 chars
        console = Console(width=200)
    console.print(table)
    if caption:
        console.print(caption, soft_wrap=True)


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the flags every benchmark shares: ``--json PATH``, ``--quick`` (smoke run), ``--seed``."""
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write results as JSON here")
    parser.add_argument(
        "--quick", action="store_true", help="tiny smoke run (seconds), numbers not meaningful"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for synthetic inputs")
    return parser


DTYPES = ("float32", "bfloat16")  # what a benchmark's --dtype offers (our CPU engine runs both)


def add_dtype_arg(parser: argparse.ArgumentParser, what: str) -> None:
    """``--dtype float32|bfloat16`` (default float32); ``what`` says what it sets."""
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help=what)


def dtype_key_suffix(dtype: str) -> str:
    """What a run's summary keys end in: "_bf16" for a bfloat16 run (beside the float32 run's keys)."""
    return "_bf16" if dtype == "bfloat16" else ""


def _jsonable(v: Any) -> Any:
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, tuple) and hasattr(v, "_asdict"):
        return {k: _jsonable(x) for k, x in v._asdict().items()}
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no inf/nan
    return v


def write_json(
    path: Path | str | None,
    *,
    summary: dict[str, Any],
    results: Any = None,
    machine: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Write ``{"machine", "config", "results", "summary"}`` to ``path`` (no-op when ``path`` is None).

    ``summary`` holds the headline numbers (ratios against the baseline) that a reader or a CI
    check looks at first. Returns the document written, or None.
    """
    if path is None:
        return None
    doc = _jsonable(
        {
            "machine": machine if machine is not None else machine_info(),
            "config": config or {},
            "results": results if results is not None else [],
            "summary": summary,
        }
    )
    p = Path(path)
    if p.parent != Path(""):
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return doc
