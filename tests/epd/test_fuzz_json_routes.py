"""Property-based fuzz of the JSON routes of a real ``epd serve`` (the shared one: embedded default
models, loopback fetches allowed): random bodies and valid bodies with one field mutated, for
``/v1/chat/completions``, ``/v1/completions`` and ``/v1/encode`` (media parts included: data: URIs
of a real JPEG, and URLs of the test's own media server). Whatever comes in, the answer is a
status below 500 with a JSON error body when it is not a 200, and the ingress's event loop was
not stalled for more than 100 ms while answering it (its own watcher's figure, ``/health``
``loop_lag_ms``); the server is still healthy after, its memory grew by a bounded amount (and, at
the fixture's end, it has left nothing in /dev/shm). Bounded: a fixed number of examples."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.epd.conftest import Media, ServeProcess, http_json, request
from tests.epd.test_e2e_errors import check_error
from tests.system.conftest import vm_rss_kib

STALL_MS = 100.0  # the longest the ingress's event loop may be held by one fuzzed request
RSS_GROWTH_KIB = 200 * 1024  # what the whole fuzz may add to the ingress's resident memory

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/encode")
FIELDS = (
    "messages", "prompt", "items", "model", "max_tokens", "temperature", "top_p", "top_k", "seed",
    "stop", "stop_token_ids", "n", "best_of", "logprobs", "echo", "stream", "stream_options",
    "return_token_ids", "kv_transfer", "multimodal", "prompt_embeds", "ignore_eos", "user",
)  # fmt: skip

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)


def _valid(route: str, image_uri: str, jpeg_url: str) -> dict[str, Any]:
    if route == "/v1/encode":
        return {"items": [{"url": jpeg_url}, {"data": image_uri}]}
    if route == "/v1/completions":
        return {"prompt": "hello there", "max_tokens": 2, "temperature": 0}
    parts = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": image_uri}},
    ]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 2, "temperature": 0}


def _mutate(body: Any, path: list[Any], value: Any) -> Any:
    """``body`` with the value at ``path`` (as far as it reaches) replaced by ``value``."""
    if not path or not isinstance(body, dict | list):
        return value
    key, rest = path[0], path[1:]
    if isinstance(body, dict):
        k = key if isinstance(key, str) and key in body else next(iter(body), None)
        return {**body, k: _mutate(body.get(k), rest, value)} if k is not None else value
    i = key % len(body) if isinstance(key, int) and body else 0
    return [*body[:i], _mutate(body[i], rest, value), *body[i + 1 :]] if body else value


@pytest.fixture(scope="module")
def rss_before(epd_server: ServeProcess) -> int:
    """The ingress's resident memory before the first fuzzed body."""
    return vm_rss_kib(epd_server.proc.pid)


def _check(server: ServeProcess, route: str, payload: bytes) -> None:
    reply = request("POST", f"{server.url}{route}", payload, {"content-type": "application/json"}, timeout=60)
    assert reply.status < 500, (route, payload[:300], reply.body)
    if reply.status != 200:
        check_error(reply.status, reply.body, reply.status)
    _, health = http_json("GET", f"{server.url}/health")
    stall = health["loop_lag_ms"]["last_5s"]
    assert stall < STALL_MS, f"the event loop stalled {stall} ms around {route} {payload[:200]!r}"


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(ROUTES), body=json_values)
def test_random_bodies_are_never_a_5xx(
    epd_server: ServeProcess, rss_before: int, route: str, body: Any
) -> None:
    _check(epd_server, route, json.dumps(body).encode())


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    route=st.sampled_from(ROUTES),
    path=st.lists(
        st.sampled_from(FIELDS)
        | st.integers(0, 3)
        | st.sampled_from(("content", "url", "type", "image_url")),
        max_size=5,
    ),
    value=json_values,
)
def test_mutated_valid_bodies_are_never_a_5xx(
    epd_server: ServeProcess, media: Media, route: str, path: list[Any], value: Any
) -> None:
    image_uri = "data:image/jpeg;base64," + base64.b64encode(media.jpeg).decode()
    body = _mutate(_valid(route, image_uri, media.jpeg_url), path, value)
    _check(epd_server, route, json.dumps(body).encode())


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    route=st.sampled_from(ROUTES),
    raw=st.binary(max_size=200)
    | st.sampled_from(
        [b"NaN", b"[" * 70 + b"]" * 70, b'{"max_tokens": 1e999}', b"1" + b"0" * 5000, b'{"a": "\xff"}']
    ),
)
def test_bytes_that_are_not_json_are_a_4xx(epd_server: ServeProcess, route: str, raw: bytes) -> None:
    _check(epd_server, route, raw)


def test_the_server_is_healthy_after_the_fuzz(epd_server: ServeProcess, rss_before: int) -> None:
    status, body = http_json("GET", f"{epd_server.url}/health")
    assert status == 200 and body["status"] == "ok", body
    grown = vm_rss_kib(epd_server.proc.pid) - rss_before
    assert grown < RSS_GROWTH_KIB, f"the ingress grew by {grown} KiB over the fuzz"
