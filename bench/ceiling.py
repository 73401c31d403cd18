"""The forward-only ceiling: how many corpus images per second the encoder's forward alone can do.

No download, decode, preprocessing, HTTP or cache: the corpus images are preprocessed once, then
forwards run back to back over batches packed like the worker's batcher packs them (arrival order,
at most ``patch_budget`` patches, an item larger than the budget alone). A service can at best
approach this rate; ``QPS / ceiling`` says how much of the machine the pipeline leaves to the model.

Measured in the benchmark process while no service is running, so it has the whole CPU, like the
service's encoder would if nothing else ran.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import torch

from encoder.checkpoint import load_encoder
from encoder.model import VisionTransformer
from media_io.config import MediaLimits, PreprocessConfig
from media_io.preprocess import Patches, get_backend


class Ceiling(NamedTuple):
    images_per_s: float
    patches_per_s: float
    images: int  # images forwarded in the timed part
    seconds: float
    patch_budget: int


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


def _forward(model: VisionTransformer, items: Sequence[Patches]) -> torch.Tensor:
    pixels = torch.cat([p.pixel_values for p in items])  # [sum N, 1176]
    grid = torch.tensor([p.grid_thw for p in items], dtype=torch.long)  # [K, 3]
    return model(pixels, grid)  # [sum N // 4, out_hidden]


def forward_ceiling(
    images: Sequence[bytes],
    *,
    patch_budget: int = 16384,
    min_seconds: float = 3.0,
    preprocess: PreprocessConfig = PreprocessConfig(),
) -> Ceiling:
    """Images/s of forwards alone over ``images`` (cycled) for at least ``min_seconds`` after one warm-up pass."""
    model = load_encoder(None).model.eval()
    backend = get_backend("cpu", preprocess)
    patches = [backend.image_bytes(b, MediaLimits(), f"ceiling-{i}") for i, b in enumerate(images)]
    batches = pack([p.pixel_values.shape[0] for p in patches], patch_budget)
    with torch.inference_mode():
        for batch in batches:  # warm-up: allocator, kernels, caches
            _forward(model, [patches[i] for i in batch])
        done_images = done_patches = 0
        t0 = time.perf_counter()
        while True:
            for batch in batches:
                _forward(model, [patches[i] for i in batch])
                done_images += len(batch)
                done_patches += sum(patches[i].pixel_values.shape[0] for i in batch)
            elapsed = time.perf_counter() - t0
            if elapsed >= min_seconds:
                break
    return Ceiling(done_images / elapsed, done_patches / elapsed, done_images, elapsed, patch_budget)
