"""Video decode benchmark: sampled-frame segment decode vs a naive single pass, in one run.

    python -m bench.video [--quick] [--json PATH] [--minutes M] [--repeats N]

Input: a generated 1280x720 30 fps H.264 clip (10 minutes; 1 with ``--quick``), made once with
PyAV (x264 ultrafast, keyframe every 250 frames, like x264's default) and cached under
``$EPD_BENCH_CACHE`` (default ``~/.cache/epd-bench``). Every variant produces the same output,
the 2 fps Qwen2-VL sample of the clip at its smart_resize target size, [T, H, W, 3] uint8:

- ``naive``: one pass with PyAV's default decoder settings, every frame converted to RGB at the
  source size, the sampled ones kept and resized (what a straightforward loader does);
- ``naive-threaded``: the same with FFmpeg frame+slice threading (``thread_type="AUTO"``);
- ``ours-1proc``: ``decode_video(workers=1)``: only sampled frames are converted, codec threads on;
- ``ours-pool``: ``decode_video(workers=<cores>)``: keyframe segments in the process pool.

The outputs are compared (max |diff| over all pixels must be 0). The summary holds
``speedup_vs_naive`` (naive / ours-pool) and seconds of wall time per minute of video.
"""

from __future__ import annotations

import argparse
import io
import os
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from bench.common import (
    add_common_args,
    format_machine,
    machine_info,
    percentiles,
    print_table,
    usable_cores,
    write_json,
)
from media_io.config import MediaLimits, PreprocessConfig
from media_io.video import decode_video, probe_video
from media_io.video_decode import FrameResizer, shutdown_pools, warm_pool
from media_io.video_sampling import sample_frame_indices, target_size

WIDTH, HEIGHT, FPS, KEYINT = 1280, 720, 30, 250


def cache_dir() -> Path:
    return Path(os.environ.get("EPD_BENCH_CACHE", Path.home() / ".cache" / "epd-bench"))


def make_clip(minutes: float, seed: int) -> Path:
    """The cached clip of ``minutes`` (generated on first use; a few minutes for 10 minutes)."""
    path = cache_dir() / f"clip_{WIDTH}x{HEIGHT}_{FPS}fps_k{KEYINT}_{minutes:g}min_s{seed}.mp4"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    n = int(minutes * 60 * FPS)
    rng = np.random.default_rng(seed)
    # A canvas twice as wide as the frame, panned a few pixels per frame: smooth motion that
    # x264 codes as real P-frames, and cheap to produce (a crop, no per-frame maths).
    yy, xx = np.mgrid[0:HEIGHT, 0 : 2 * WIDTH].astype(np.float32)
    luma = 128 + 60 * np.sin(xx / 37.0) * np.cos(yy / 23.0) + rng.normal(0, 6, xx.shape)
    luma = np.clip(luma, 16, 235).astype(np.uint8)  # [H, 2W]
    chroma_u = np.clip(128 + 40 * np.sin(xx[::2, ::2] / 53.0), 16, 240).astype(np.uint8)  # [H/2, W]
    chroma_v = np.clip(128 + 40 * np.cos(yy[::2, ::2] / 41.0), 16, 240).astype(np.uint8)
    print(f"generating {n} frames of {WIDTH}x{HEIGHT} into {path} (once) ...", flush=True)
    t0 = time.perf_counter()
    with av.open(str(tmp), mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.options = {"preset": "ultrafast", "crf": "28", "x264-params": f"keyint={KEYINT}"}
        for i in range(n):
            x = (i * 3) % WIDTH
            x -= x % 2
            yuv = np.concatenate(
                [
                    luma[:, x : x + WIDTH],
                    np.concatenate(
                        [chroma_u[:, x // 2 : x // 2 + WIDTH // 2], chroma_v[:, x // 2 : x // 2 + WIDTH // 2]]
                    ).reshape(HEIGHT // 2, WIDTH),
                ]
            )  # [H * 3 / 2, W]: Y plane, then U and V planes
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(yuv), format="yuv420p")
            frame.pts = i
            frame.time_base = Fraction(1, FPS)
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    tmp.rename(path)
    print(f"generated in {time.perf_counter() - t0:.0f} s", flush=True)
    return path


def naive(data: bytes, cfg: PreprocessConfig, threaded: bool) -> np.ndarray:
    """Decode every frame to RGB at the source size in one pass, keep the sampled ones, resize."""
    info = probe_video(data)
    indices = sample_frame_indices(info.num_frames, info.fps, cfg)
    height, width = target_size(info.height, info.width, len(indices), cfg)
    wanted = set(indices)
    resizer = FrameResizer(height, width, "exact")
    kept: list[np.ndarray] = []
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        if threaded:
            stream.thread_type = "AUTO"
        for i, frame in enumerate(container.decode(stream)):
            rgb = frame.to_ndarray(format="rgb24")  # [h, w, 3] every frame
            if i in wanted:
                kept.append(resizer.resize_rgb(rgb))
    return np.stack(kept)


def _children_cpu(pids: set[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (Linux /proc; 0 where unreadable)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument(
        "--minutes", type=float, default=None, help="clip length (default 10, 1 with --quick)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed runs per variant (default 1, 2 quick)"
    )
    parser.add_argument("--workers", type=int, default=None, help="pool size (default: usable cores)")
    args = parser.parse_args()
    minutes = args.minutes if args.minutes is not None else (1.0 if args.quick else 10.0)
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 1)
    workers = args.workers or max(2, usable_cores())

    machine = machine_info()
    data = make_clip(minutes, args.seed).read_bytes()
    cfg = PreprocessConfig()
    limits = MediaLimits(max_bytes=max(len(data), MediaLimits().max_bytes))
    info = probe_video(data, limits=limits)

    variants = {
        "naive": lambda: naive(data, cfg, threaded=False),
        "naive-threaded": lambda: naive(data, cfg, threaded=True),
        "ours-1proc": lambda: decode_video(data, cfg, limits, workers=1).frames,
        f"ours-pool({workers})": lambda: decode_video(data, cfg, limits, workers=workers).frames,
    }
    # Process start-up is paid once per service, not per video. The workers' pids let us add
    # their CPU time to ours: on a shared machine wall time mostly measures the neighbours.
    worker_pids = warm_pool(workers)
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    outputs: dict[str, np.ndarray] = {}
    for _ in range(repeats):
        for name, fn in variants.items():  # interleaved, so drift in the machine's load is shared
            c0 = time.process_time() + _children_cpu(worker_pids)
            t0 = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() + _children_cpu(worker_pids) - c0)
            print(f"{name}: {times[name][-1]:.2f} s wall, {cpu[name][-1]:.2f} s cpu", flush=True)
    shutdown_pools()

    ref = outputs["naive"]
    base = percentiles(times["naive"]).p50
    base_cpu = percentiles(cpu["naive"]).p50
    video_min = info.duration_s / 60.0
    rows, results = [], []
    for name, ts in times.items():
        p, c = percentiles(ts), percentiles(cpu[name])
        out = outputs[name]
        same = out.shape == ref.shape
        max_diff = int(np.abs(out.astype(np.int16) - ref.astype(np.int16)).max()) if same else -1
        rows.append(
            [name, p.p50, p.p90, p.p99, p.p50 / video_min, base / p.p50, c.p50, base_cpu / c.p50, max_diff]
        )
        results.append(
            {
                "variant": name,
                "wall_s": ts,
                "cpu_s": cpu[name],
                "p50_s": p.p50,
                "p90_s": p.p90,
                "p99_s": p.p99,
                "s_per_video_min": p.p50 / video_min,
                "speedup_vs_naive": base / p.p50,
                "cpu_p50_s": c.p50,
                "cpu_speedup_vs_naive": base_cpu / c.p50,
                "max_abs_diff_vs_naive": max_diff,
            }
        )
    print_table(
        f"video decode: {info.width}x{info.height} {info.fps:g} fps, {info.duration_s / 60:.1f} min, "
        f"{len(ref)} sampled frames at {ref.shape[2]}x{ref.shape[1]}",
        ["variant", "P50 s", "P90 s", "P99 s", "s/video min", "speedup", "cpu s", "cpu speedup", "max|diff|"],
        rows,
        caption=format_machine(machine)
        + f" | load avg {os.getloadavg()[0]:.1f} | pool workers {workers} | repeats {repeats}",
    )
    pool_name = f"ours-pool({workers})"

    def p50(d: dict[str, list[float]], k: str) -> float:
        return percentiles(d[k]).p50

    summary = {
        "speedup_vs_naive": base / p50(times, pool_name),
        "speedup_vs_naive_threaded": p50(times, "naive-threaded") / p50(times, pool_name),
        "speedup_1proc_vs_naive": base / p50(times, "ours-1proc"),
        "cpu_speedup_vs_naive": base_cpu / p50(cpu, pool_name),
        "s_per_video_min": p50(times, pool_name) / video_min,
        "naive_s_per_video_min": base / video_min,
        "outputs_identical": all(r["max_abs_diff_vs_naive"] == 0 for r in results),
        "load_average_1min": os.getloadavg()[0],
        "video_minutes": video_min,
        "sampled_frames": len(ref),
    }
    write_json(
        args.json, summary=summary, results=results, machine=machine, config=vars(args) | {"workers": workers}
    )


if __name__ == "__main__":
    main()
