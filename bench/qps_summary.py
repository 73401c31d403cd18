"""The encoder QPS benchmark's headline numbers: ratios between the matching runs of the two
services, and the forward-only ceiling they are compared with (see ``bench.encoder_qps``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from bench import report
from bench.ceiling import Ceiling


def summarize(records: list[dict[str, Any]], ceiling: Any) -> dict[str, Any]:
    """The headline numbers. ``ceiling`` has ``images_per_s`` (the forward-only rate the cold QPS
    is compared with), or is None."""

    def find(service: str, phase: str, mode: str) -> dict[str, Any] | None:
        return next(
            (r for r in records if r["service"] == service and r["phase"] == phase and r["mode"] == mode),
            None,
        )

    base, ours = find("baseline", "cold", "closed"), find("ours", "cold", "closed")
    base_open, ours_open = find("baseline", "cold", "open"), find("ours", "cold", "open")
    hot = find("ours", "hot", "closed")
    video = find("ours", "video", "closed")
    ours_qps = ours["qps"] if ours else None
    summary: dict[str, Any] = {
        "baseline_qps": base["qps"] if base else None,
        "ours_qps": ours_qps,
        "qps_ratio": report.ratio(ours_qps, base["qps"] if base else None),
        "baseline_p90_ms": base["latency_ms"]["p90"] if base else None,
        "ours_p90_ms": ours["latency_ms"]["p90"] if ours else None,
        "p90_ratio": report.ratio(
            ours["latency_ms"]["p90"] if ours else None, base["latency_ms"]["p90"] if base else None
        ),
        "open_loop_p90_ratio": report.ratio(
            ours_open["latency_ms"]["p90"] if ours_open else None,
            base_open["latency_ms"]["p90"] if base_open else None,
        ),
        "hot_qps": hot["qps"] if hot else None,
        "hot_hit_rate": hot["cache_hit_rate"] if hot else None,
        "hot_over_cold_qps": report.ratio(hot["qps"] if hot else None, ours_qps),
        "video_qps": video["qps"] if video else None,
        "video_p50_ms": video["latency_ms"]["p50"] if video else None,
        "ceiling_images_per_s": ceiling.images_per_s if ceiling else None,
        "ceiling_fraction": report.ratio(ours_qps, ceiling.images_per_s if ceiling else None),
        # The most any pipeline around this forward could reach as qps_ratio on this machine.
        "ceiling_over_baseline_qps": report.ratio(
            ceiling.images_per_s if ceiling else None, base["qps"] if base else None
        ),
        "baseline_cpu_ms_per_request": base["service_cpu_ms_per_request"] if base else None,
        "ours_cpu_ms_per_request": ours["service_cpu_ms_per_request"] if ours else None,
        "ceiling_cpu_ms_per_image": getattr(ceiling, "cpu_ms_per_image", None),
        # The load generator and media server share the machine: they should cost little.
        "client_cpu_ms_per_request": ours["client_cpu_ms_per_request"] if ours else None,
        "errors": sum(r["errors"] for r in records),
    }
    # The CPU-time analogue of ceiling_fraction: the share of our service's CPU per image that the
    # forward alone needs. Background load on a shared machine moves it far less than wall rates.
    summary["cpu_fraction"] = report.ratio(
        summary["ceiling_cpu_ms_per_image"], summary["ours_cpu_ms_per_request"]
    )
    summary["targets_met"] = {
        "qps_ratio>=2.5": summary["qps_ratio"] is not None and summary["qps_ratio"] >= 2.5,
        "p90_ratio<=1": summary["p90_ratio"] is not None and summary["p90_ratio"] <= 1.0,
        "ceiling_fraction>=0.8": summary["ceiling_fraction"] is not None
        and summary["ceiling_fraction"] >= 0.8,
    }
    return summary


class InterleavedCeiling(NamedTuple):
    images_per_s: float  # mean over the measurement points of the better configuration there
    points: int
    cpu_ms_per_image: float  # the least CPU per image any measured forward-only run spent


def interleaved_ceiling(points: Sequence[Sequence[Ceiling]]) -> InterleavedCeiling | None:
    """Mean over measurement points of each point's best forward-only rate (None: none measured)."""
    best = [max(c.images_per_s for c in runs) for runs in points if runs]
    if not best:
        return None
    cpu = min(c.cpu_s / c.images * 1e3 for runs in points for c in runs if c.images)
    return InterleavedCeiling(sum(best) / len(best), len(best), cpu)
