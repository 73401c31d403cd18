"""The encoder worker process: configuration, placement and the blocking ``serve_worker``.

One process per device: each CUDA device gets its own worker; on a CPU-only host a configurable
number of workers split the cores between them (torch intra-op threads are per process, and two
processes spinning on the same cores thrash). ``plan_workers`` turns one base ``WorkerConfig``
into the per-process configs a launcher starts; ``serve_worker`` runs one of them under uvicorn
(the HTTP routes live in ``encoder/serving/worker_app.py``).

How a CPU worker spends its cores: by default one single-threaded forward per core
(``forward_streams`` = cores, ``torch_threads`` = 1) rather than one forward with a thread per
core. The vision tower's ops are small (a 1080p image is ~4.9k rows of a few hundred columns), so
intra-op threads spend much of each op at a barrier, and on a shared host any other runnable
thread (the ingress, a decode, a neighbour) stalls every barrier; independent streams never wait
for each other. A GPU worker keeps one stream and the patch budget large: there batching is what
fills the device.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from epd_common.runtime import check_dtype, resolve_device, resolve_dtype, serve_internal
from epd_common.store_config import StoreConfig
from media_io.config import MediaLimits, PreprocessConfig


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one encoder worker process needs. ``uds`` (a unix socket path) wins over host/port.

    ``public_url``: the address other nodes use to reach this worker; when set, every
    EmbeddingRef carries ``{public_url}/embeddings/{key}`` so a remote LLM engine can fetch the
    bytes. ``torch_threads`` (intra-op threads per forward) and ``forward_streams`` (forwards at
    once) None mean "decide from the host" (``plan_workers``: a CPU worker gets one stream per core
    of its share, one thread each; a GPU worker one stream). ``patch_budget`` None means 16384 on
    a GPU and 4096 on a CPU (where batching buys no throughput and a big batch only delays its
    first items). Admission (items past the cache check: decoding, preprocessing or queued for the
    forward) is by expected wait, in patches: an item is refused (503, Retry-After the expected
    wait) when the patches admitted ahead of it plus its own would take longer than
    ``max_queue_wait_s`` (or the client's shorter timeout) at the measured patches per second
    (seeded with ``admission_seed_patches_per_s``); audio clips likewise in mel frames against the
    audio stage's own rate (``admission_seed_mel_frames_per_s``); ``max_queued_bytes`` and
    ``max_inflight`` are memory guards.
    """

    host: str = "127.0.0.1"
    port: int = 8001
    uds: str | None = None
    public_url: str | None = None
    model_path: str | None = None  # None: the embedded default checkpoint
    dtype: str = "auto"  # "auto": the checkpoint's (config.json), float32 for the embedded default
    device: str = "auto"  # "auto": cuda when available, else cpu
    torch_threads: int | None = None
    forward_streams: int | None = None
    patch_budget: int | None = None
    max_wait_ms: float = 5.0
    max_queue_patches: int | None = None  # None: 8 patch budgets
    max_inflight: int = 1024  # memory guard (items); admission is by expected wait
    max_queued_bytes: int = 512 << 20  # memory guard: compressed bytes of the admitted items
    max_queue_wait_s: float = 10.0  # admission deadline: the expected wait a new item may have
    admission_seed_patches_per_s: float = 20000.0  # the rate assumed until measured
    admission_seed_mel_frames_per_s: float = 2000.0  # the audio stage's, likewise
    decode_threads: int = 2  # decode + preprocess executor threads
    video_decode_workers: int | None = 1  # processes per video decode (1: in the decode thread)
    preprocess_backend: str = "cpu"  # "cpu" | "dali"
    cache_namespace: str = "default"
    cache_capacity_bytes: int | None = None  # None: keep the namespace's budget (1 GiB when new)
    cache_root: str | None = None  # None: /dev/shm/epd-<namespace>
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    limits: MediaLimits = field(default_factory=MediaLimits)
    store: StoreConfig = field(default_factory=StoreConfig)  # the tier shared by the nodes
    log_level: str = "warning"

    def __post_init__(self) -> None:
        check_dtype("WorkerConfig.dtype", self.dtype)
        if self.preprocess_backend not in ("cpu", "dali"):
            raise ValueError(
                f"WorkerConfig.preprocess_backend must be 'cpu' or 'dali', got {self.preprocess_backend!r}"
            )
        for name in ("max_inflight", "decode_threads", "max_queued_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"WorkerConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_queue_wait_s", "admission_seed_patches_per_s", "admission_seed_mel_frames_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"WorkerConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("torch_threads", "forward_streams", "patch_budget"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"WorkerConfig.{name} must be >= 1, got {value}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype: ``dtype``, or with "auto" the checkpoint's (``resolve_dtype``)."""
        return resolve_dtype(self.dtype, self.model_path)

    def resolve_device(self) -> torch.device:
        return resolve_device(self.device)

    def batch_budget(self) -> int:
        """``patch_budget``, or the device's default when unset."""
        if self.patch_budget is not None:
            return self.patch_budget
        return 16384 if self.resolve_device().type == "cuda" else 4096

    @property
    def url(self) -> str:
        """How a local client reaches this worker (``http://unix`` style when on a socket)."""
        return self.public_url or (f"http://{self.host}:{self.port}" if not self.uds else "http://localhost")


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def plan_workers(base: WorkerConfig, cpu_workers: int = 1) -> list[WorkerConfig]:
    """Per-process configs: one per CUDA device when ``base.device`` is auto/cuda and GPUs exist,
    else ``cpu_workers`` CPU workers with the cores divided among them (at least one each). A CPU
    worker's share goes to ``forward_streams`` single-threaded forwards unless ``torch_threads``
    or ``forward_streams`` say otherwise (streams * threads = the share).

    Worker i listens on ``base.port + i``, or ``{base.uds}.{i}`` when ``base.uds`` is set.
    """
    device = base.resolve_device()
    if device.type == "cuda" and base.device in ("auto", "cuda"):
        devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        threads = base.torch_threads or max(1, usable_cores() // max(1, len(devices)))
        streams = base.forward_streams or 1
    else:
        if cpu_workers < 1:
            raise ValueError(f"cpu_workers must be >= 1, got {cpu_workers}")
        devices = [str(device)] * cpu_workers
        share = max(1, usable_cores() // cpu_workers)
        if base.torch_threads is None:
            streams = base.forward_streams or share
            threads = max(1, share // streams)
        else:
            threads = base.torch_threads
            streams = base.forward_streams or max(1, share // threads)
    configs = []
    for i, dev in enumerate(devices):
        configs.append(
            dataclasses.replace(
                base,
                device=dev,
                torch_threads=threads,
                forward_streams=streams,
                port=base.port + i,
                uds=f"{base.uds}.{i}" if base.uds and len(devices) > 1 else base.uds,
            )
        )
    return configs


def serve_worker(config: WorkerConfig) -> None:
    """Run one encoder worker until interrupted (blocks). The model loads during start-up, so the
    server answers /health only once it can encode."""
    from encoder.serving.worker_app import build_app

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    app = build_app(config)
    if config.uds:
        Path(config.uds).unlink(missing_ok=True)  # a stale socket from a killed worker
    serve_internal(app, uds=config.uds, host=config.host, port=config.port, log_level=config.log_level)


run_worker = serve_worker  # the name the agreed API uses
