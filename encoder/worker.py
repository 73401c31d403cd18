"""The encoder worker process: configuration, placement and the blocking ``serve_worker``.

One process per device: each CUDA device gets its own worker; on a CPU-only host a configurable
number of workers split the cores between them (torch intra-op threads are per process, and two
processes spinning on the same cores thrash). ``plan_workers`` turns one base ``WorkerConfig``
into the per-process configs a launcher starts; ``serve_worker`` runs one of them under uvicorn
(the HTTP routes live in ``encoder/worker_app.py``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from epd.runtime import DTYPES, check_dtype, resolve_device
from media_io.config import MediaLimits, PreprocessConfig


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one encoder worker process needs. ``uds`` (a unix socket path) wins over host/port.

    ``public_url``: the address other nodes use to reach this worker; when set, every
    EmbeddingRef carries ``{public_url}/embeddings/{key}`` so a remote LLM engine can fetch the
    bytes. ``torch_threads`` None means every usable core (set it when several workers share a
    host; ``plan_workers`` does). ``max_inflight`` bounds items admitted past the cache check
    (decoding, preprocessing or queued for the forward); beyond it /encode answers 503.
    """

    host: str = "127.0.0.1"
    port: int = 8001
    uds: str | None = None
    public_url: str | None = None
    model_path: str | None = None  # None: the embedded default checkpoint
    dtype: str = "float32"
    device: str = "auto"  # "auto": cuda when available, else cpu
    torch_threads: int | None = None
    patch_budget: int = 16384
    max_wait_ms: float = 5.0
    max_queue_patches: int | None = None  # None: 8 patch budgets
    max_inflight: int = 64
    decode_threads: int = 2  # decode + preprocess executor threads
    video_decode_workers: int | None = 1  # processes per video decode (1: in the decode thread)
    preprocess_backend: str = "cpu"  # "cpu" | "dali"
    cache_namespace: str = "default"
    cache_capacity_bytes: int | None = None  # None: keep the namespace's budget (1 GiB when new)
    cache_root: str | None = None  # None: /dev/shm/epd-<namespace>
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    limits: MediaLimits = field(default_factory=MediaLimits)
    log_level: str = "warning"

    def __post_init__(self) -> None:
        check_dtype("WorkerConfig.dtype", self.dtype)
        if self.preprocess_backend not in ("cpu", "dali"):
            raise ValueError(
                f"WorkerConfig.preprocess_backend must be 'cpu' or 'dali', got {self.preprocess_backend!r}"
            )
        for name in ("patch_budget", "max_inflight", "decode_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"WorkerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"WorkerConfig.torch_threads must be >= 1, got {self.torch_threads}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def resolve_device(self) -> torch.device:
        return resolve_device(self.device)

    @property
    def url(self) -> str:
        """How a local client reaches this worker (``http://unix`` style when on a socket)."""
        return self.public_url or (f"http://{self.host}:{self.port}" if not self.uds else "http://localhost")


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def plan_workers(base: WorkerConfig, cpu_workers: int = 1) -> list[WorkerConfig]:
    """Per-process configs: one per CUDA device when ``base.device`` is auto/cuda and GPUs exist,
    else ``cpu_workers`` CPU workers with the cores divided among them (at least one thread each).

    Worker i listens on ``base.port + i``, or ``{base.uds}.{i}`` when ``base.uds`` is set.
    """
    device = base.resolve_device()
    if device.type == "cuda" and base.device in ("auto", "cuda"):
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        threads = base.torch_threads or max(1, usable_cores() // max(1, len(devices)))
    else:
        if cpu_workers < 1:
            raise ValueError(f"cpu_workers must be >= 1, got {cpu_workers}")
        devices = [str(device)] * cpu_workers
        threads = base.torch_threads or max(1, usable_cores() // cpu_workers)
    configs = []
    for i, dev in enumerate(devices):
        configs.append(
            dataclasses.replace(
                base,
                device=dev,
                torch_threads=threads,
                port=base.port + i,
                uds=f"{base.uds}.{i}" if base.uds and len(devices) > 1 else base.uds,
            )
        )
    return configs


def serve_worker(config: WorkerConfig) -> None:
    """Run one encoder worker until interrupted (blocks). The model loads during start-up, so the
    server answers /health only once it can encode."""
    import uvicorn

    from encoder.worker_app import build_app

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    app = build_app(config)
    if config.uds:
        Path(config.uds).unlink(missing_ok=True)  # a stale socket from a killed worker
        uvicorn.run(app, uds=config.uds, log_level=config.log_level)
    else:
        uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level)


run_worker = serve_worker  # the name the agreed API uses
