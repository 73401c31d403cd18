"""Frozen configuration of the ingress role. The encoder worker and the LLM engine own their
configs (``encoder.serving.worker.WorkerConfig``, ``llm_core.serving.server.LLMServerConfig``); ``epd serve``
composes all three in ``epd.serve_cmd``, the one place the CLI maps onto fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from epd.llm_routing.policy import RouterConfig
from epd_common.model_id import served_model_names
from epd_common.store_config import StoreConfig
from media_io.config import FetchConfig, MediaLimits, PreprocessConfig


@dataclass(frozen=True)
class IngressConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    encoder_urls: tuple[str, ...] = ()
    encoder_weights: tuple[int, ...] = ()  # capacity weight per encoder url (default 1 each)
    llm_urls: tuple[str, ...] = ()  # the LLM engines chats are routed over (none: /v1/encode only)
    llm_roles: tuple[str, ...] = ()  # per url: "prefill" | "decode" | "both" (default: all both)
    llm_router: RouterConfig = field(default_factory=RouterConfig)
    # Who answers chats: epd's engine ("epd", `epd llm`), or vLLM servers ("vllm": started with
    # --enable-mm-embeds; epd hands them the embeddings as image_embeds / video_embeds parts)
    llm_server: Literal["epd", "vllm"] = "epd"
    # vLLM only: hand the embeddings over as files in this folder, which vLLM reads with its
    # ECExampleConnector (--ec-transfer-config, ec_consumer; epd passes it to the vLLM it starts);
    # the requests then carry only grids and uuids. None: the bytes go inline (the default).
    vllm_ec_path: str | None = None
    # The folder's budget: least-recently-used files beyond it are deleted, never one in use (so it
    # is exceeded by what is in use); 0: never delete (the operator cleans up).
    vllm_ec_max_bytes: int = 4 << 30
    # vLLM only: each server's KV-event stream, in the order of the LLM urls: "ENDPOINT" or
    # "ENDPOINT,REPLAY_ENDPOINT" (its --kv-events-config; "" for a server without one). The router
    # recomputes the server's block hashes (it must run --prefix-caching-hash-algo sha256_cbor) and
    # routes by its prefix cache once its own events confirm the recipe; otherwise by load.
    vllm_kv_events: tuple[str, ...] = ()
    vllm_block_size: int = 128  # the servers' --block-size (vLLM's default on CPU; 16 on GPU)
    # How chats reach vLLM: "tokens" (epd renders and tokenizes, vLLM's /inference/v1/generate, on
    # with its --enable-scale-out), "chat" (/v1/chat/completions: vLLM renders), "auto" (tokens
    # where every server serves it; videos and structured outputs go by the chat route)
    vllm_route: Literal["auto", "chat", "tokens"] = "auto"
    llm_model_dir: str | None = None  # for the tokenizer and chat template; None = embedded default
    # The model ids served (--served-model-name, repeatable; epd.served_model): /v1/models lists
    # them, responses report the first; empty: llm_model_dir as typed, else "epd-default"
    served_model_name: tuple[str, ...] = ()
    # Admission: 413 for what is too large; 503 (Retry-After = the expected wait) when a request's
    # items would not be done within max_queue_wait_s (or the client's shorter X-Request-Timeout)
    # at the rate this ingress has been resolving them. Under `epd serve` the encoder workers and
    # engines inherit max_queue_wait_s unless their own flag is given. The two counts are memory
    # guards, not the admission rule.
    max_body_bytes: int = 256 * 1024 * 1024
    # JSON bodies (chat, completions, /v1/encode with URLs): parsed whole, so capped lower (epd.http)
    max_json_body_bytes: int = 8 * 1024 * 1024
    max_items: int = 64
    max_queue_wait_s: float = 10.0
    max_inflight_items: int = 4096
    max_inflight_chats: int = 1024
    request_timeout_s: float = 600.0
    health_interval_s: float = 1.0
    cache_namespace: str = "default"
    cache_capacity_bytes: int | None = None  # None: keep the namespace's budget (set by the workers)
    fetch: FetchConfig = field(default_factory=FetchConfig)
    limits: MediaLimits = field(default_factory=MediaLimits)
    preprocess: PreprocessConfig = field(default_factory=PreprocessConfig)
    store: StoreConfig = field(default_factory=StoreConfig)  # the tier shared by the nodes

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return served_model_names(self.served_model_name, self.llm_model_dir)

    @property
    def model_name(self) -> str:
        """The id responses report (the first served id)."""
        return self.served_model_names[0]
