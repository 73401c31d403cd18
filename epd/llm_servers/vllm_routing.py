"""What the router needs to know of each vLLM server to route by its prefix cache.

vLLM's /health says nothing of its cache, so the deployment says it (``--vllm-kv-events``, one per
``--llm-url``, and ``--vllm-block-size``), and each server's client hands it to the router in the
form every LLM server's /health has for it (``epd.llm_routing.llm_router.LLMRouter.on_health``):

    page_size                    the server's --block-size
    page_naming                  "vllm-sha256_cbor" (``epd.llm_routing.vllm_block_hash``)
    kv_events_endpoint           its --kv-events-config endpoint (absent: no events)
    kv_events_replay_endpoint    its replay_endpoint
    kv_events_topic              its topic ("" by default)

The server must run ``--prefix-caching-hash-algo sha256_cbor`` (the default ``sha256`` pickles
Python objects, which cannot be recomputed outside vLLM) without ``PYTHONHASHSEED``; its events
show whether it does, and one that does not is routed by load (its /health row says why).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any, NamedTuple

from epd.llm_routing.vllm_block_hash import SCHEME

# what every epd-started vLLM runs, and docs/vllm.md asks of an external one
HASH_ALGO = "sha256_cbor"


class KVEventsAt(NamedTuple):
    """Where one vLLM server publishes its KV events."""

    endpoint: str
    replay: str | None = None
    topic: str = ""


def parse_kv_events(values: Sequence[str], urls: Sequence[str]) -> dict[str, KVEventsAt | None]:
    """``--vllm-kv-events`` values ("ENDPOINT" or "ENDPOINT,REPLAY"; "" for none) by server url, in
    the order of the urls; ValueError when there are more values than servers."""
    if len(values) > len(urls):
        raise ValueError(
            f"{len(values)} --vllm-kv-events given for {len(urls)} LLM urls: one per url, in order"
        )
    out: dict[str, KVEventsAt | None] = {u: None for u in urls}
    for url, value in zip(urls, values, strict=False):
        endpoint, _, replay = value.strip().partition(",")
        if endpoint:
            out[url] = KVEventsAt(endpoint.strip(), replay.strip() or None)
    return out


def routing_health(events: KVEventsAt | None, block_size: int) -> dict[str, Any]:
    """The fields a vLLM server's client adds to its /health for the router."""
    out: dict[str, Any] = {"page_size": block_size, "page_naming": SCHEME}
    if events is not None:
        out.update(
            kv_events_endpoint=events.endpoint,
            kv_events_replay_endpoint=events.replay,
            kv_events_topic=events.topic,
        )
    return out


def local_kv_events() -> KVEventsAt:
    """Endpoints for a vLLM on this machine: unix sockets in a private folder (0700). vLLM binds
    its PUB only to a wildcard TCP address or an ipc:// one (any other TCP address it *connects*
    to, and a router connecting there too would never meet it; only the replay, which vLLM always
    binds, would answer, a second late); a wildcard would open it to the network."""
    folder = tempfile.mkdtemp(prefix="epd-kv-events-")
    return KVEventsAt(f"ipc://{folder}/pub", f"ipc://{folder}/replay")


def remove_local(events: KVEventsAt) -> None:
    """Remove the folder of ``local_kv_events`` endpoints (once their server has stopped)."""
    if events.endpoint.startswith("ipc://"):
        shutil.rmtree(os.path.dirname(events.endpoint.removeprefix("ipc://")), ignore_errors=True)


def kv_events_config(events: KVEventsAt) -> str:
    """The ``--kv-events-config`` JSON that makes a vLLM server publish at ``events``. vLLM binds
    its live endpoint only when it is a wildcard (``tcp://*:5557``) or ipc://; ValueError for any
    other, which vLLM would connect to instead (the router could never receive its live events)."""
    if events.endpoint.startswith("tcp://") and not _wildcard(events.endpoint):
        raise ValueError(
            f"vLLM binds its KV-event endpoint only on a wildcard host (tcp://*:PORT) or ipc://; "
            f"{events.endpoint} it would connect to"
        )
    body: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events.endpoint,
        "topic": events.topic,
    }
    if events.replay:
        body["replay_endpoint"] = events.replay
    return json.dumps(body)


def _wildcard(endpoint: str) -> bool:
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    return host in ("*", "[::]", "::", "0.0.0.0")
