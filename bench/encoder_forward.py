"""Vision encoder forward throughput: batch size one vs a patch budget, and the images/s ceiling.

    python -m bench.encoder_forward [--model DIR] [--depth N] [--image-size 448] [--patch-budget 8192]
                                    [--frame-sizes 1920x1080,3840x2160] [--repeats 10] [--threads N]
                                    [--json PATH] [--quick]

Baseline and candidate run in the same process on the same inputs:
  - bs1:      one 448x448 image (1024 patches at 14 px, 784 at 16 px) per forward,
  - budget:   as many images as fit in ``--patch-budget`` patches per forward (what the worker's
              batcher packs under load),
  - batcher:  the same budget through ``EncodeBatcher`` with concurrent submitters (adds the asyncio
              queue, the forward thread and the per-item split), to show its overhead.
``summary.ceiling_images_per_s`` is the best forward-only images/s: the upper bound the service
QPS benchmark compares against. Inputs are random patch rows (decode and preprocessing are not
part of the forward and are measured elsewhere).

``--model DIR`` takes any supported tower checkpoint (its family from config.json); ``--depth N``
keeps its first N blocks (real widths, a quick look at a big tower). ``--frame-sizes`` adds one
forward per frame of each size (rounded to whole merge units) and reports ms per frame: with band
windows (MiMo) the ratio between two sizes stays near their patch-count ratio (1080p -> 4K: ~4x),
where full attention grows with its square.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import NamedTuple, cast

import torch

from bench.common import (
    Percentiles,
    add_common_args,
    format_machine,
    machine_info,
    percentiles,
    print_table,
    timed_runs,
    write_json,
)
from encoder.models.checkpoint import load_encoder
from encoder.models.family import VisionTower
from encoder.serving.batcher import EncodeBatcher
from media_io.preprocess import Patches


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward_case(model: VisionTower, images: list[Patches], repeats: int) -> list[float]:
    pixels = torch.cat([p.pixel_values for p in images]).to(model.device)
    grid = torch.tensor([p.grid_thw for p in images])

    def run() -> None:
        with torch.inference_mode():
            model(pixels, grid)
        _sync(model.device)

    return timed_runs(run, repeats=repeats, warmup=2)


def _batcher_case(model: VisionTower, images: list[Patches], budget: int, rounds: int) -> float:
    """Seconds to push ``rounds`` x len(images) items through the batcher (all submitted at once)."""

    async def run() -> float:
        async with EncodeBatcher(model, patch_budget=budget, max_wait_ms=2.0) as batcher:
            await asyncio.gather(*(batcher.encode(p) for p in images))  # warm-up
            t0 = time.perf_counter()
            await asyncio.gather(*(batcher.encode(p) for _ in range(rounds) for p in images))
            return time.perf_counter() - t0

    return asyncio.run(run())


def _frame_sizes(text: str) -> list[tuple[int, int]]:
    """ "1920x1080,3840x2160" -> [(1920, 1080), (3840, 2160)] (width x height)."""
    try:
        sizes = [tuple(int(v) for v in part.lower().split("x")) for part in text.split(",") if part]
    except ValueError:
        sizes = []
    if not sizes or any(len(s) != 2 or min(s) < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of WxH sizes")
    return [(s[0], s[1]) for s in sizes]


class FrameCase(NamedTuple):
    name: str  # "frame WxH"
    patches: int
    latency_ms: Percentiles

    def row(self) -> dict[str, object]:
        return {"case": self.name, "images": 1, "patches": self.patches, "latency_ms": self.latency_ms,
                "patches_per_s": self.patches / (self.latency_ms.p50 / 1e3),
                "images_per_s": 1e3 / self.latency_ms.p50}  # fmt: skip


def _frame_cases(
    model: VisionTower, sizes: list[tuple[int, int]], repeats: int, gen: torch.Generator
) -> list[FrameCase]:
    """One forward of a single frame per size: the frame rounded to whole merge units (as the
    preprocessing's resize does), in patches (1, h, w)."""
    cfg = model.config
    unit_px, merge = cfg.patch_size * cfg.spatial_merge_size, cfg.spatial_merge_size
    cases: list[FrameCase] = []
    for width, height in sizes:
        h = max(1, round(height / unit_px)) * merge
        w = max(1, round(width / unit_px)) * merge
        frame = [Patches(torch.randn(h * w, cfg.patch_dim, generator=gen), (1, h, w))]
        lat = percentiles([s * 1e3 for s in _forward_case(model, frame, max(2, repeats // 2))])  # ms
        cases.append(FrameCase(f"frame {width}x{height}", h * w, lat))
    return cases


def _keep_blocks(model: VisionTower, depth: int) -> None:
    """Keep the tower's first ``depth`` blocks (every tower keeps them in ``blocks``)."""
    module = cast(torch.nn.Module, model)
    blocks = cast(torch.nn.ModuleList, module.blocks)
    if not 1 <= depth <= len(blocks):
        raise SystemExit(f"--depth {depth} is not in [1, {len(blocks)}]")
    module.blocks = blocks[:depth]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: embedded default)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--image-size", type=int, default=448, help="square image side in pixels (multiple of patch x merge)"
    )
    parser.add_argument("--patch-budget", type=int, default=8192)
    parser.add_argument("--depth", type=int, default=None, help="keep the tower's first N blocks")
    parser.add_argument(
        "--frame-sizes",
        type=_frame_sizes,
        default=[],
        metavar="WxH[,WxH...]",
        help="also time one frame of each size (e.g. 1920x1080,3840x2160)",
    )
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.image_size, args.patch_budget, args.repeats = 224, 1024, 2
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_encoder(args.model, dtype=getattr(torch, args.dtype), device="cpu")
    if args.depth is not None:
        _keep_blocks(loaded.model, args.depth)
    model = cast(VisionTower, cast(torch.nn.Module, loaded.model).to(args.device))
    cfg = model.config
    unit_px = cfg.patch_size * cfg.spatial_merge_size
    if args.image_size % unit_px:
        parser.error(f"--image-size {args.image_size} is not a multiple of {unit_px} (patch x merge)")
    side = args.image_size // cfg.patch_size
    per_image = side * side
    n_batch = max(1, args.patch_budget // per_image)
    gen = torch.Generator().manual_seed(args.seed)
    images = [
        Patches(torch.randn(per_image, cfg.patch_dim, generator=gen), (1, side, side)) for _ in range(n_batch)
    ]

    results: list[dict[str, object]] = []
    budget_name = f"budget {n_batch * per_image}"
    rates: dict[str, float] = {}
    for name, batch in {"bs1": images[:1], budget_name: images}.items():
        reps = args.repeats if len(batch) == 1 else max(2, args.repeats // 2)
        lat = percentiles([s * 1e3 for s in _forward_case(model, batch, reps)])  # ms
        rates[name] = len(batch) / (lat.p50 / 1e3)
        results.append(
            {"case": name, "images": len(batch), "patches": len(batch) * per_image, "latency_ms": lat,
             "patches_per_s": rates[name] * per_image, "images_per_s": rates[name]}
        )  # fmt: skip

    frames = _frame_cases(model, args.frame_sizes, args.repeats, gen)
    results.extend(f.row() for f in frames)

    rounds = 1 if args.quick else 3
    total_s = _batcher_case(model, images, args.patch_budget, rounds)
    batcher_rate = rounds * len(images) / total_s
    results.append(
        {"case": "batcher", "images": rounds * len(images), "patches": rounds * len(images) * per_image,
         "latency_ms": None, "patches_per_s": batcher_rate * per_image, "images_per_s": batcher_rate}
    )  # fmt: skip
    nan = float("nan")
    rows: list[list[object]] = []
    for r in results:
        r_lat = r["latency_ms"]
        p50_90_99 = (r_lat.p50, r_lat.p90, r_lat.p99) if isinstance(r_lat, Percentiles) else (nan, nan, nan)
        rows.append([r["case"], r["images"], r["patches"], *p50_90_99, r["patches_per_s"], r["images_per_s"]])

    bs1, budget = rates["bs1"], rates[budget_name]
    machine = machine_info()
    depth = f", first {args.depth} blocks" if args.depth is not None else ""
    print_table(
        f"vision encoder forward, {args.image_size}x{args.image_size} images ({per_image} patches), "
        f"{args.dtype} on {args.device}{depth}",
        ["case", "images", "patches", "P50 ms", "P90 ms", "P99 ms", "patches/s", "images/s"],
        rows,
        caption=f"{format_machine(machine)}\nfingerprint {loaded.fingerprint[:16]}  "
        f"budget/bs1 = {budget / bs1:.2f}x  batcher/forward = {batcher_rate / budget:.2f}x",
    )
    summary: dict[str, object] = {
        "image_size": args.image_size,
        "patch_budget": args.patch_budget,
        "bs1_patches_per_s": bs1 * per_image,
        "budget_patches_per_s": budget * per_image,
        "budget_vs_bs1": budget / bs1,
        "batcher_images_per_s": batcher_rate,
        "batcher_vs_forward": batcher_rate / budget,
        "ceiling_images_per_s": max(bs1, budget),
    }
    if frames:  # last size vs first: ~ the patch ratio when attention cost is linear in patches
        summary["frame_ms"] = {f.name: f.latency_ms.p50 for f in frames}
        summary["frame_time_ratio"] = frames[-1].latency_ms.p50 / frames[0].latency_ms.p50
        summary["frame_patch_ratio"] = frames[-1].patches / frames[0].patches
    write_json(args.json, summary=summary, results=results, machine=machine, config=vars(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
