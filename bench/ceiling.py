"""The forward-only ceiling: how many corpus images per second the encoder's forward alone can do.

No download, decode, preprocessing, HTTP or cache: the corpus images are preprocessed once, then
forwards run back to back over batches packed like the worker's batcher packs them (arrival order,
at most ``patch_budget`` patches, an item larger than the budget alone). A service can at best
approach this rate; ``QPS / ceiling`` says how much of the machine the pipeline leaves to the model.

A CPU can spend its cores on a forward in two ways, and the ceiling is the better of them
(:func:`best_ceiling`), so the fraction never flatters a service that picked the other one:

    streams x threads     S forwards run at once in S Python threads (torch releases the GIL),
                          each with ``threads`` intra-op threads; S * threads = the cores
    1 x cores             one forward at a time, every core inside it (the baseline's way)
    cores x 1             one forward per core, no intra-op threads (the worker's CPU default)

Measured in the benchmark process while no service is running, so it has the whole CPU, like the
service's encoder would if nothing else ran.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from encoder.models.checkpoint import load_encoder
from encoder.models.family import VisionTower
from media_io.config import MediaLimits, PreprocessConfig
from media_io.preprocess import Patches, get_backend


class Ceiling(NamedTuple):
    images_per_s: float
    patches_per_s: float
    images: int  # images forwarded in the timed part
    seconds: float
    patch_budget: int
    streams: int = 1  # forwards running at once
    threads: int = 1  # torch intra-op threads of each forward
    cpu_s: float = float("nan")  # process CPU time of the timed part

    @property
    def label(self) -> str:
        return f"{self.streams} stream(s) x {self.threads} thread(s)"


def pack(sizes: Sequence[int], patch_budget: int) -> list[list[int]]:
    """Indices of ``sizes`` grouped greedily in order into batches of at most ``patch_budget`` patches
    (a single item above the budget forms its own batch)."""
    batches: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(sizes):
        if cur and used + n > patch_budget:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        batches.append(cur)
    return batches


def _forward(model: VisionTower, items: Sequence[Patches]) -> torch.Tensor:
    pixels = torch.cat([p.pixel_values for p in items])  # [sum N, 1176]
    grid = torch.tensor([p.grid_thw for p in items], dtype=torch.long)  # [K, 3]
    return model(pixels, grid)  # [sum N // 4, out_hidden]


def preprocess_corpus(
    images: Sequence[bytes], preprocess: PreprocessConfig = PreprocessConfig()
) -> list[Patches]:
    """Every image through the worker's CPU preprocessing, once."""
    backend = get_backend("cpu", preprocess)
    return [backend.image_bytes(b, MediaLimits(), f"ceiling-{i}") for i, b in enumerate(images)]


def measure(
    model: VisionTower,
    patches: Sequence[Patches],
    *,
    patch_budget: int,
    min_seconds: float,
    streams: int = 1,
    threads: int | None = None,
) -> Ceiling:
    """Forward-only images/s of ``streams`` concurrent forward loops with ``threads`` intra-op
    threads each (None: torch's current setting), for at least ``min_seconds`` after a warm-up pass.

    The streams take batches from one shared cycle over the corpus, like a worker's forward
    threads take them from one queue.
    """
    if streams < 1:
        raise ValueError(f"streams must be >= 1, got {streams}")
    batches = pack([p.pixel_values.shape[0] for p in patches], patch_budget)
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            for batch in batches:  # warm-up: allocator, kernels, caches
                _forward(model, [patches[i] for i in batch])
        lock = threading.Lock()
        ticket = itertools.count()
        done = [0, 0]  # images, patches
        t0 = time.perf_counter()
        cpu0 = time.process_time()

        def loop() -> None:
            with torch.inference_mode():
                while time.perf_counter() - t0 < min_seconds:
                    with lock:
                        batch = batches[next(ticket) % len(batches)]
                    _forward(model, [patches[i] for i in batch])
                    with lock:
                        done[0] += len(batch)
                        done[1] += sum(patches[i].pixel_values.shape[0] for i in batch)

        workers = [threading.Thread(target=loop, name=f"ceiling-{s}") for s in range(streams)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - t0
        cpu_s = time.process_time() - cpu0
        used_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    return Ceiling(
        done[0] / elapsed, done[1] / elapsed, done[0], elapsed, patch_budget, streams, used_threads, cpu_s
    )


def forward_ceiling(
    images: Sequence[bytes],
    *,
    patch_budget: int = 16384,
    min_seconds: float = 3.0,
    preprocess: PreprocessConfig = PreprocessConfig(),
    streams: int = 1,
    threads: int | None = None,
    model_path: str | None = None,
) -> Ceiling:
    """Images/s of forwards alone over ``images`` (cycled): one configuration, see :func:`measure`."""
    model = load_encoder(model_path).model.eval()
    patches = preprocess_corpus(images, preprocess)
    return measure(
        model, patches, patch_budget=patch_budget, min_seconds=min_seconds, streams=streams, threads=threads
    )


def best_ceiling(
    images: Sequence[bytes],
    *,
    cores: int,
    patch_budget: int = 16384,
    min_seconds: float = 3.0,
    preprocess: PreprocessConfig = PreprocessConfig(),
    model_path: str | None = None,
) -> list[Ceiling]:
    """Both ways of using ``cores`` (1 x cores, then cores x 1; once when cores is 1), best first."""
    model = load_encoder(model_path).model.eval()
    patches = preprocess_corpus(images, preprocess)
    configs = [(1, cores)] if cores == 1 else [(1, cores), (cores, 1)]
    runs = [
        measure(model, patches, patch_budget=patch_budget, min_seconds=min_seconds, streams=s, threads=t)
        for s, t in configs
    ]
    return sorted(runs, key=lambda c: c.images_per_s, reverse=True)
