"""Several LLM engines behind one ingress (``--llm-instances 2``): the router reads each engine's
KV events and sends a conversation's turns to the engine that holds its history, predicting the
engine's own hit; kill -9 of an engine loses no request (it is re-routed before any output) and the
restarted engine rejoins with a cleared index."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.epd.conftest import ServeProcess, http_json, start_serve
from tests.system.conftest import child_pids, pid_alive, shm_entries, stop_checked, wait_until

RESTART_TIMEOUT_S = 150.0
SYSTEM = "You are a terse assistant. " * 20  # ~540 bytes: a prefix every conversation shares


@pytest.fixture(scope="module")
def two_engines() -> Iterator[ServeProcess]:
    before = shm_entries("serve-")
    server = start_serve(["--llm-instances", "2", "--llm-torch-threads", "1", "--health-interval-s", "0.3"])
    try:
        yield server
    finally:
        stop_checked(server, before)


def routing(server: ServeProcess) -> dict[str, Any]:
    status, body = http_json("GET", f"{server.url}/health")
    assert status == 200, body
    out = body["llm_routing"]
    assert isinstance(out, dict)
    return out


def routed(server: ServeProcess) -> dict[str, int]:
    return {e["url"]: e["routed"] for e in routing(server)["engines"]}


def chat(server: ServeProcess, messages: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """One turn; returns the body and the engine it went to (the one whose count moved)."""
    before = routed(server)
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    status, out = http_json("POST", f"{server.url}/v1/chat/completions", body)
    assert status == 200, out
    moved = [u for u, n in routed(server).items() if n != before.get(u)]
    assert len(moved) == 1, (before, routed(server))
    return out, moved[0]


def conversation(server: ServeProcess, name: str, turns: int) -> list[tuple[dict[str, Any], str]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    out = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"{name}, question {t}: " + "why? " * 30})
        body, engine = chat(server, messages)
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        out.append((body, engine))
        time.sleep(0.3)  # the engine's KV events reach the router (loopback, a few ms) before the next turn
    return out


def engine_pid(server: ServeProcess, url: str) -> int:
    port = url.rsplit(":", 1)[1]
    for pid in child_pids(server.proc.pid, "llm"):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if "--port" in argv and argv[argv.index("--port") + 1] == port:
            return pid
    raise AssertionError(f"no engine process listens on {url}")


@pytest.mark.timeout(300)
def test_turns_follow_their_history_and_the_router_predicts_the_engines_hit(
    two_engines: ServeProcess,
) -> None:
    wait_until(
        lambda: [e["mode"] for e in routing(two_engines)["engines"]] == ["events", "events"],
        60,
        "both engines to report their KV events endpoints",
    )
    turns = conversation(two_engines, "Ada", 4)
    engines = {engine for _, engine in turns}
    assert len(engines) == 1, f"one conversation's turns went to {engines}"
    cached = [body["usage"]["prompt_tokens_details"]["cached_tokens"] for body, _ in turns]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    stats = routing(two_engines)
    predicted = sum(e["predicted_cached_tokens"] for e in stats["engines"])
    actual = sum(e["actual_cached_tokens"] for e in stats["engines"])
    assert predicted == actual == sum(cached), stats  # router and engine agree on every hit


@pytest.mark.timeout(400)
def test_kill9_engine_loses_no_request_and_rejoins(two_engines: ServeProcess) -> None:
    turns = conversation(two_engines, "Bob", 2)
    home = turns[-1][1]
    old_instance = {e["url"]: e["instance_id"] for e in routing(two_engines)["engines"]}[home]
    pid = engine_pid(two_engines, home)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), 10, "the killed engine to be reaped")
    # The supervisor tells the router once it has reaped the child: a zombie is already "not
    # alive" above, so wait for the router's own view before counting where requests go.
    wait_until(
        lambda: not next(e for e in routing(two_engines)["engines"] if e["url"] == home)["live"],
        10,
        "the router to mark the killed engine down",
    )
    # Every chat now completes on the surviving engine, none of them tried on the dead one.
    for i in range(3):
        body, engine = chat(two_engines, [{"role": "user", "content": f"after the kill {i}"}])
        assert engine != home and body["choices"][0]["message"]["role"] == "assistant"
    wait_until(
        lambda: any(
            e["url"] == home and e["live"] and e["instance_id"] not in (None, old_instance)
            for e in routing(two_engines)["engines"]
        ),
        RESTART_TIMEOUT_S,
        "the restarted engine to rejoin the routing set",
        interval_s=0.5,
    )
    # It rejoined with nothing cached: the index the router kept of the old instance is gone.
    e = next(e for e in routing(two_engines)["engines"] if e["url"] == home)
    assert e["index_pages"] == 0, e
    # and new conversations reach it again (cold requests tie and break at random)
    seen = set()
    deadline = time.monotonic() + 60
    while home not in seen:
        assert time.monotonic() < deadline, f"no request reached the restarted engine: {seen}"
        seen.add(chat(two_engines, [{"role": "user", "content": f"fresh {len(seen)} {time.time()}"}])[1])
