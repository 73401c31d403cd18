"""What the router is told of each vLLM server (epd/llm_servers/vllm_routing.py)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from epd.llm_routing.vllm_block_hash import SCHEME
from epd.llm_servers.vllm_routing import (
    KVEventsAt,
    kv_events_config,
    local_kv_events,
    parse_kv_events,
    remove_local,
    routing_health,
)


def test_kv_events_pair_with_the_urls_in_order() -> None:
    urls = ["http://a:1", "http://b:1", "http://c:1"]
    got = parse_kv_events(["tcp://a:5557,tcp://a:5558", "", "tcp://c:5557"], urls)
    assert got == {
        "http://a:1": KVEventsAt("tcp://a:5557", "tcp://a:5558"),
        "http://b:1": None,
        "http://c:1": KVEventsAt("tcp://c:5557"),
    }
    with pytest.raises(ValueError, match="one per url"):
        parse_kv_events(["x", "y"], ["http://a:1"])


def test_the_health_a_client_adds_for_the_router() -> None:
    assert routing_health(None, 32) == {"page_size": 32, "page_naming": SCHEME}
    h = routing_health(KVEventsAt("tcp://a:1", "tcp://a:2"), 128)
    assert h["kv_events_endpoint"] == "tcp://a:1" and h["kv_events_topic"] == ""


def test_vllm_is_only_given_endpoints_it_binds() -> None:
    """vLLM binds a wildcard or ipc:// endpoint and connects to any other TCP one: a config it
    would connect with is refused (the router would only ever hear the replay)."""
    with pytest.raises(ValueError, match="wildcard"):
        kv_events_config(KVEventsAt("tcp://127.0.0.1:5557"))
    cfg = json.loads(kv_events_config(KVEventsAt("tcp://*:5557", "tcp://*:5558")))
    assert cfg["endpoint"] == "tcp://*:5557" and cfg["replay_endpoint"] == "tcp://*:5558"
    local = local_kv_events()
    assert local.endpoint.startswith("ipc://") and local.replay and local.replay.startswith("ipc://")
    folder = os.path.dirname(local.endpoint.removeprefix("ipc://"))
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    json.loads(kv_events_config(local))
    remove_local(local)
    assert not os.path.exists(folder)
