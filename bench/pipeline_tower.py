"""The tower of ``bench.encoder_qps --pipeline-bound``: a Qwen2.5-VL-shaped tower small enough that
its forward is a small part of a request, as on an accelerator (where a 448x448 image's forward
takes a few milliseconds against tens for download, decode and preprocessing), so the benchmark
measures the pipeline around the forward, which is what the seed's 15 -> 30 QPS was about.

One window-attention block of width 32 (one head, 112-px windows, no full-attention block, so its
cost grows linearly with the image): 0.12 GFLOP of projections for a 448x448 image, under a fifth
of the embedded default's 0.66, whose two full-attention blocks also grow with the square of a
large image's patches. Its weights are random (``random_encoder``) from a fixed seed and it is
written once under the benchmark cache as a real checkpoint, loaded by every side the same way.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from bench.llm import build_once, cache_dir
from encoder.models.checkpoint import random_encoder, save_vision_checkpoint
from encoder.models.config import VisionConfig

PIPELINE_TOWER = VisionConfig(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=1,
    out_hidden_size=256,
    window_size=112,
    fullatt_block_indexes=(),
)
PIPELINE_TOWER_SEED = 20261202


def ensure_pipeline_tower() -> Path:
    """The tower's checkpoint directory, created on first use."""
    key = hashlib.sha256(repr((PIPELINE_TOWER, PIPELINE_TOWER_SEED)).encode()).hexdigest()[:12]
    return build_once(
        cache_dir() / f"encoder-pipeline-{key}",
        lambda tmp: save_vision_checkpoint(random_encoder(PIPELINE_TOWER, PIPELINE_TOWER_SEED), tmp),
    )
