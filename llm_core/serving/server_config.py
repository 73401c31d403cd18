"""Configuration of the LLM engine process (``epd llm``): frozen dataclasses, one per concern.

``EngineConfig`` is what the engine itself needs (KV budget, batching limits, queue bound);
``LLMServerConfig`` adds where to listen, which checkpoint to load and where to read embeddings.
The CLI maps its flags onto these fields in one place (``epd/llm_cmd.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from epd_common.model_id import served_model_names
from epd_common.runtime import check_dtype, resolve_device, resolve_dtype
from epd_common.store_config import StoreConfig


@dataclass(frozen=True)
class EngineConfig:
    """Limits of one engine instance.

    ``max_num_batched_tokens`` bounds the tokens of one forward (prefill is chunked to fit);
    ``max_num_seqs`` the sequences decoded together. Admission is by expected wait
    (``llm_core.serving.admission``): a request is refused (503) when its first token would come
    later than 90% of ``max_queue_wait_s`` (or of the client's shorter timeout) at the measured tokens per
    second (``admission_seed_tokens_per_s`` until measured); ``max_waiting`` requests
    waiting is a memory guard. ``kv_memory_bytes`` is one block pool that every KV group draws
    from; ``window_fraction`` splits it into a pool per group instead (a fixed share for the windows).
    """

    kv_memory_bytes: int = 64 * 1024 * 1024
    page_size: int = 16
    window_fraction: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int | None = None  # per-sequence cap on one step's prefill chunk
    # While streams decode, a step that also prefills takes at most this many times a decode-only
    # step (measured: ``step_cost.py``), and at least the floor. 0 (default): only
    # max_num_batched_tokens bounds it. On one closed-loop wave, 8 cut the medium model's ITL P99
    # at c = 32 from ~1.1 s to ~0.4 s for ~5-20% of throughput (bench.llm: 2.97x vs 3.68x)
    prefill_stall_factor: float = 0.0
    prefill_step_floor_ms: float = 25.0
    # An idle engine that gets a request waits while more keep coming (each within
    # ``burst_quiet_ms`` of the last), at most ``burst_gather_ms`` in all, before its first step:
    # a burst's prompts then share the first steps instead of one prompt running alone while the
    # rest queue behind it (a wave of 32 reached the engine over ~6-10 ms, 0.1-0.2 ms apart, and
    # the first step took one prompt). 0: start at once. A lone request waits burst_quiet_ms; within
    # a burst the quiet is 3x that, and the gather ends once the waiting prompts fill a step.
    burst_gather_ms: float = 10.0
    burst_quiet_ms: float = 1.0
    max_waiting: int = 4096  # memory guard (requests waiting); admission is by expected wait
    max_queue_wait_s: float = 10.0  # admission deadline of a request that sends no timeout
    # the rate assumed until measured (8 steps): a guess, high enough that the first burst into an
    # idle engine (32 chats of ~300 tokens) is taken within 90% of the deadline
    admission_seed_tokens_per_s: float = 2000.0
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    enable_prefix_cache: bool = True
    # host memory for pages the prefix cache evicts (copied back when a prefix returns); 0: none
    host_kv_bytes: int = 0
    # With a host tier and a store (``LLMServerConfig.store``): which host pages also go to the
    # store, where any engine sharing it can fetch them. "write_through": every spilled page
    # (a session can return to another engine or node); "host_evict": only pages the host tier
    # drops for room; "off": the store keeps embeddings only.
    kv_store_policy: Literal["write_through", "host_evict", "off"] = "write_through"
    # Copy KV from the host tier layer by layer beside the forward that reads it (the forward's
    # layer i waits until layer i is copied) instead of in a step of its own.
    kv_copy_overlap: bool = True
    seed: int | None = None  # of the shared generator used by unseeded sampled requests
    # Draft tokens the model's MTP heads propose per step, verified in one forward (0: off; at most
    # the checkpoint's MTP heads). Sampled requests verify by rejection sampling (same distribution).
    speculative_steps: int = 0

    def __post_init__(self) -> None:
        for name in ("kv_memory_bytes", "page_size", "max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_queue_wait_s", "admission_seed_tokens_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.prefill_stall_factor < 0 or self.prefill_step_floor_ms < 0:
            raise ValueError("EngineConfig.prefill_stall_factor and prefill_step_floor_ms must be >= 0")
        if self.burst_gather_ms < 0 or self.burst_quiet_ms < 0:
            raise ValueError("EngineConfig.burst_gather_ms and burst_quiet_ms must be >= 0")
        if self.speculative_steps < 0:
            raise ValueError(f"EngineConfig.speculative_steps must be >= 0, got {self.speculative_steps}")


@dataclass(frozen=True)
class LLMServerConfig:
    """Everything ``serve_llm`` needs. ``uds`` (a unix socket path) wins over host/port."""

    host: str = "127.0.0.1"
    port: int = 8002
    uds: str | None = None
    model_path: str | None = None  # None: the embedded default checkpoint
    # The ids /v1/models lists (responses report the first); empty: model_path as typed, else
    # "epd-default" (``served_model_names``)
    served_model_name: tuple[str, ...] = ()
    dtype: str = "auto"  # "auto": the checkpoint's (config.json), float32 for the embedded default
    device: str = "auto"  # "auto": cuda when available, else cpu
    engine: EngineConfig = field(default_factory=EngineConfig)
    cache_namespace: str = "default"  # node embedding cache to read multimodal embeddings from
    fetch_timeout_s: float = 30.0  # for embeddings fetched from a remote encoder's URL
    log_level: str = "warning"
    # torch intra-op threads of the engine process: torch ops, BLAS and the CPU decoder-layer
    # kernel (llm_core.kernels.cpu_layer); None: torch's default (one per core)
    torch_threads: int | None = None
    # Publish the prefix cache's changes as KV events (ZMQ PUB, vLLM's schema; e.g.
    # tcp://127.0.0.1:5557) and answer replays of recent batches on the second address.
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    # What the ingress uses this engine for: "prefill" (computes prompts and hands their KV
    # over), "decode" (takes the KV in and generates), "both" (either, or all of a request).
    role: Literal["prefill", "decode", "both"] = "both"
    # How prompt KV moves between engines: "shm" (one node) or "mooncake" (TCP, across nodes)
    kv_transport: Literal["shm", "mooncake"] = "shm"
    # The shared cache tier (Redis / Valkey, or a directory): with a host tier, evicted KV pages go
    # there too (``EngineConfig.kv_store_policy``) and come back from there
    store: StoreConfig = field(default_factory=StoreConfig)

    def __post_init__(self) -> None:
        check_dtype("LLMServerConfig.dtype", self.dtype)
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ValueError(f"LLMServerConfig.torch_threads must be >= 1, got {self.torch_threads}")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype: ``dtype``, or with "auto" the checkpoint's (``resolve_dtype``)."""
        return resolve_dtype(self.dtype, self.model_path)

    def resolve_device(self) -> torch.device:
        return resolve_device(self.device)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return served_model_names(self.served_model_name, self.model_path)

    @property
    def model_dir(self) -> Path | None:
        return None if self.model_path is None else Path(self.model_path)
