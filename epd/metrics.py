"""Prometheus metrics of the ingress.

One registry per app instance (tests start several apps in one process). Encoder queue depth,
batch sizes and KV usage are owned by the encoder and engine processes; the ingress mirrors the
values their ``/health`` reports on each health poll, so one scrape of ``/metrics`` shows the node.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

STAGES = ("download", "decode", "preprocess", "queue", "forward", "total")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class IngressMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "epd_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.stage_seconds = Histogram(
            "epd_stage_seconds", "Per-item stage latency", ["stage"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.request_seconds = Histogram(
            "epd_request_seconds", "Request latency by route", ["route"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.cache_hits = Counter(
            "epd_embed_cache_hits", "Embedding cache hits seen by the ingress", registry=r
        )
        self.cache_misses = Counter(
            "epd_embed_cache_misses", "Embedding cache misses seen by the ingress", registry=r
        )
        self.store_hits = Counter(
            "epd_store_hits", "Node-cache misses the shared store answered (no encoder call)", registry=r
        )
        self.store_misses = Counter(
            "epd_store_misses", "Node-cache misses the shared store did not have", registry=r
        )
        self.store_up = Gauge(
            "epd_store_up", "1 while the shared store answers, 0 while it is left alone", registry=r
        )
        self.store_errors = Gauge(
            "epd_store_errors",
            "Shared-store calls of the ingress that failed (recomputed instead)",
            registry=r,
        )
        self.media_items = Counter("epd_media_items", "Media items by modality", ["modality"], registry=r)
        self.inflight = Gauge("epd_inflight_requests", "Requests being served by the ingress", registry=r)
        self.expected_wait = Gauge(
            "epd_ingress_expected_wait_seconds",
            "When a one-item request arriving now would be done (admission's estimate)",
            registry=r,
        )
        self.refusals = Counter(
            "epd_refusals",
            "Requests refused at admission, by stage (ingress; encoder: every worker refused; engine: every LLM engine behind, from its last refusal) and reason",
            ["stage", "reason"],
            registry=r,
        )
        self.encoder_queue_depth = Gauge(
            "epd_encoder_queue_depth", "Items waiting in each encoder worker", ["worker"], registry=r
        )
        self.encoder_batch_size = Gauge(
            "epd_encoder_last_batch_items",
            "Items in the last forward of each encoder worker",
            ["worker"],
            registry=r,
        )
        self.encoders_up = Gauge("epd_encoders_up", "Encoder workers in the ring", registry=r)
        self.kv_usage = Gauge("epd_kv_usage", "LLM KV pool usage (0..1)", ["pool"], registry=r)
        self.llm_waiting = Gauge("epd_llm_waiting_requests", "Requests waiting in the LLM engine", registry=r)
        self.completion_tokens = Counter("epd_completion_tokens", "Generated tokens", registry=r)
        self.loop_lag_worst = Gauge(
            "epd_event_loop_lag_max_seconds",
            "The longest the ingress's event loop was stalled since start (epd_common.loop_lag)",
            registry=r,
        )

    def observe_timings(self, timings_ms: dict[str, float]) -> None:
        for stage, ms in timings_ms.items():
            if stage in STAGES:
                self.stage_seconds.labels(stage=stage).observe(ms / 1000.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
