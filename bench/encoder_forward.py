"""Vision encoder forward throughput: batch size one vs a patch budget, and the images/s ceiling.

    python -m bench.encoder_forward [--model DIR] [--image-size 448] [--patch-budget 8192]
                                    [--repeats 10] [--threads N] [--json PATH] [--quick]

Baseline and candidate run in the same process on the same inputs:
  - bs1:      one 448x448 image (1024 patches) per forward,
  - budget:   as many images as fit in ``--patch-budget`` patches per forward (what the worker's
              batcher packs under load),
  - batcher:  the same budget through ``EncodeBatcher`` with concurrent submitters (adds the asyncio
              queue, the forward thread and the per-item split), to show its overhead.
``summary.ceiling_images_per_s`` is the best forward-only images/s: the upper bound the service
QPS benchmark compares against. Inputs are random patch rows (decode and preprocessing are not
part of the forward and are measured elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

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
from encoder.models.tower import VisionTransformer
from encoder.serving.batcher import EncodeBatcher
from media_io.preprocess import Patches


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward_case(model: VisionTransformer, images: list[Patches], repeats: int) -> list[float]:
    pixels = torch.cat([p.pixel_values for p in images]).to(model.device)
    grid = torch.tensor([p.grid_thw for p in images])

    def run() -> None:
        with torch.inference_mode():
            model(pixels, grid)
        _sync(model.device)

    return timed_runs(run, repeats=repeats, warmup=2)


def _batcher_case(model: VisionTransformer, images: list[Patches], budget: int, rounds: int) -> float:
    """Seconds to push ``rounds`` x len(images) items through the batcher (all submitted at once)."""

    async def run() -> float:
        async with EncodeBatcher(model, patch_budget=budget, max_wait_ms=2.0) as batcher:
            await asyncio.gather(*(batcher.encode(p) for p in images))  # warm-up
            t0 = time.perf_counter()
            await asyncio.gather(*(batcher.encode(p) for _ in range(rounds) for p in images))
            return time.perf_counter() - t0

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: embedded default)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--image-size", type=int, default=448, help="square image side in pixels (multiple of 28)"
    )
    parser.add_argument("--patch-budget", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    add_common_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.image_size, args.patch_budget, args.repeats = 224, 1024, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    side = args.image_size // 14
    if args.image_size % 28:
        parser.error(f"--image-size {args.image_size} is not a multiple of 28")

    loaded = load_encoder(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    model = loaded.model
    per_image = side * side
    n_batch = max(1, args.patch_budget // per_image)
    gen = torch.Generator().manual_seed(args.seed)
    images = [Patches(torch.randn(per_image, 1176, generator=gen), (1, side, side)) for _ in range(n_batch)]

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
    print_table(
        f"vision encoder forward, {args.image_size}x{args.image_size} images ({per_image} patches), "
        f"{args.dtype} on {args.device}",
        ["case", "images", "patches", "P50 ms", "P90 ms", "P99 ms", "patches/s", "images/s"],
        rows,
        caption=f"{format_machine(machine)}\nfingerprint {loaded.fingerprint[:16]}  "
        f"budget/bs1 = {budget / bs1:.2f}x  batcher/forward = {batcher_rate / budget:.2f}x",
    )
    summary = {
        "image_size": args.image_size,
        "patch_budget": args.patch_budget,
        "bs1_patches_per_s": bs1 * per_image,
        "budget_patches_per_s": budget * per_image,
        "budget_vs_bs1": budget / bs1,
        "batcher_images_per_s": batcher_rate,
        "batcher_vs_forward": batcher_rate / budget,
        "ceiling_images_per_s": max(bs1, budget),
    }
    write_json(args.json, summary=summary, results=results, machine=machine, config=vars(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
