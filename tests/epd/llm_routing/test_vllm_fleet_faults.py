"""Affinity routing over two real vLLM servers (the CPU build `make vllm-peer` installs; skipped
without it) behind one ``epd serve --llm-server vllm``, and the faults a fleet meets:

- server A publishes its KV events; server B was started without them: B is routed by load (its
  row says so, a warning is logged), A by its prefix cache, and what the router predicts on A is
  what A reports cached;
- A killed mid-trace: requests go on (to B), nothing is lost; A's index is dropped when it comes
  back, and its new run is indexed again from its own events.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from epd.llm_servers.vllm_launch import VLLMLaunch, VLLMProcess, free_port, peer_python
from epd.llm_servers.vllm_routing import KVEventsAt, local_kv_events, remove_local
from tests.epd.conftest import ServeProcess, http_json, start_serve, stop_serve

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(peer_python() is None, reason="vLLM peer not installed (make vllm-peer)"),
]

BLOCK = 32  # the CPU attention takes multiples of 32
SYSTEM = " ".join(f"step {i}: keep the answer short and exact." for i in range(30))


def _launch(qwen_dir: Path, events: KVEventsAt | None, core: int) -> VLLMLaunch:
    return VLLMLaunch(
        str(qwen_dir),
        free_port(),
        dtype="float32",
        max_model_len=2048,
        kv_cache_gib=1,
        extra_args=("--block-size", str(BLOCK), "--max-num-seqs", "8"),
        env={"VLLM_CPU_OMP_THREADS_BIND": str(core)},
        kv_events=events,
    )


@pytest.fixture(scope="module")
def fleet(qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("vllm-fleet")
    events = local_kv_events()
    a = VLLMProcess(_launch(qwen_dir, events, 0), logs / "a.log", ready_timeout_s=420.0).start()
    try:
        b = VLLMProcess(_launch(qwen_dir, None, 1), logs / "b.log", ready_timeout_s=420.0).start()
        try:
            epd = start_serve(
                [
                    "--model",
                    str(qwen_dir),
                    "--llm-server",
                    "vllm",
                    "--vllm-block-size",
                    str(BLOCK),
                    "--llm-url",
                    a.url,
                    "--vllm-kv-events",
                    f"{events.endpoint},{events.replay}",
                    "--llm-url",
                    b.url,
                    "--vllm-kv-events",
                    "",
                    "--health-interval-s",
                    "0.5",
                ],
                timeout_s=300,
            )
            try:
                yield {"a": a, "b": b, "epd": epd}
            finally:
                assert stop_serve(epd) == 0, epd.tail()
        finally:
            b.stop()
    finally:
        a.stop()
        remove_local(events)


def _rows(epd: ServeProcess) -> dict[str, dict[str, Any]]:
    return {e["url"]: e for e in http_json("GET", f"{epd.url}/health")[1]["llm_routing"]["engines"]}


def _chat(epd: ServeProcess, session: int, turn: int) -> dict[str, Any]:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Session {session}, turn {turn}: what next?"},
    ]
    status, reply = http_json(
        "POST",
        f"{epd.url}/v1/chat/completions",
        {"messages": messages, "max_tokens": 4, "temperature": 0},
    )
    assert status == 200, reply
    return reply  # type: ignore[no-any-return]


def _settle(epd: ServeProcess, url: str) -> None:
    """Until the router's index of ``url`` stops growing (its events arrive after the answer)."""
    last, deadline = -1, time.monotonic() + 10
    while time.monotonic() < deadline:
        pages = _rows(epd)[url]["index_pages"]
        if pages == last:
            return
        last = pages
        time.sleep(0.4)


def test_the_server_without_events_is_routed_by_load_and_the_other_by_its_cache(
    fleet: dict[str, Any],
) -> None:
    epd, a, b = fleet["epd"], fleet["a"], fleet["b"]
    for i in range(6):
        _chat(epd, i, 0)
        _settle(epd, a.url)
    rows = _rows(epd)
    assert rows[b.url]["naming_check"] == "no KV events: routed by load"
    assert rows[a.url]["naming_check"] == "ok" and rows[a.url]["index_pages"] > 0
    # the shared system prompt is cached on A: affinity sends the next chats there, as predicted
    before = rows[a.url]
    for i in range(6, 10):
        _chat(epd, i, 0)
        _settle(epd, a.url)
    after = _rows(epd)[a.url]
    assert after["routed"] > before["routed"]
    assert after["predicted_cached_tokens"] > before["predicted_cached_tokens"]
    assert after["abs_error_tokens"] == before["abs_error_tokens"], "a prediction on A missed"


def test_a_server_killed_mid_trace_then_restarted_is_indexed_again(fleet: dict[str, Any]) -> None:
    epd, a, b = fleet["epd"], fleet["a"], fleet["b"]
    held = _rows(epd)[a.url]["index_pages"]
    assert held > 1
    a.kill()
    for i in range(4):  # nothing is lost: the chats go to B
        assert _chat(epd, 100 + i, 0)["choices"][0]["message"]["content"] is not None
    deadline = time.monotonic() + 10
    while _rows(epd)[a.url]["live"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _rows(epd)[a.url]["live"]
    a.start()  # the same ports: a new run of the server
    deadline = time.monotonic() + 60
    while not _rows(epd)[a.url]["live"] and time.monotonic() < deadline:
        time.sleep(0.5)
    row = _rows(epd)[a.url]
    # the old run's pages are gone (the new run holds at most its start-up check's prompt)
    assert row["live"] and row["index_pages"] <= 1 < held, row
    errors = _rows(epd)[a.url]["abs_error_tokens"]
    for i in range(6):
        _chat(epd, 200 + i, 0)
        _settle(epd, a.url)
    row = _rows(epd)[a.url]
    assert row["index_pages"] > 0 and row["naming_check"] == "ok", row  # the new run, indexed
    assert row["abs_error_tokens"] == errors, "a prediction on the restarted server missed"
    assert _rows(epd)[b.url]["live"]
