"""Engine fault: kill -9 the LLM engine. Chats in flight and chats sent while it is down get a
clean 503 with Retry-After (never a hang, never a 500); the supervisor restarts the engine and
later chats succeed."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.epd.conftest import Reply, ServeProcess, http_json, request
from tests.system.conftest import check_error, child_pids, pid_alive, wait_until

CLIENT_TIMEOUT_S = 30.0
RESTART_TIMEOUT_S = 150.0


def chat(server: ServeProcess, max_tokens: int) -> tuple[Reply, float]:
    body = {"messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": max_tokens}
    t0 = time.perf_counter()
    reply = request("POST", f"{server.url}/v1/chat/completions", body, timeout=CLIENT_TIMEOUT_S)
    return reply, time.perf_counter() - t0


@pytest.mark.timeout(240)
def test_kill9_engine_gives_503_then_restarts(fault_svc: ServeProcess) -> None:
    reply, _ = chat(fault_svc, 2)
    assert reply.status == 200, reply.body
    (engine_pid,) = child_pids(fault_svc.proc.pid, "llm")

    # A long chat in flight when the engine dies.
    inflight: list[tuple[Reply, float]] = []
    t = threading.Thread(target=lambda: inflight.append(chat(fault_svc, 4000)), daemon=True)
    t.start()
    time.sleep(1.0)
    os.kill(engine_pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(engine_pid), 10, "the killed engine to be reaped")
    t.join(CLIENT_TIMEOUT_S + 5)
    assert not t.is_alive(), "the in-flight chat hung after the engine died"
    (got,) = inflight
    if got[0].status != 200:  # it may have finished before the kill on a fast machine
        check_error(got[0], 503)

    # The restart loads a model (seconds): a chat sent right now is refused promptly and cleanly.
    reply, seconds = chat(fault_svc, 2)
    check_error(reply, 503)
    assert seconds < 10.0, f"the refusal took {seconds:.1f} s"

    wait_until(
        lambda: any(p != engine_pid for p in child_pids(fault_svc.proc.pid, "llm")),
        RESTART_TIMEOUT_S,
        "the supervisor to start a new engine",
    )
    wait_until(
        lambda: http_json("GET", f"{fault_svc.url}/ready")[1].get("engine_up") is True,
        RESTART_TIMEOUT_S,
        "the engine to restart",
        interval_s=0.5,
    )
    # The ingress's view of the engine lags by one health poll: until the first success, the only
    # acceptable answer is a clean 503.
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while (reply := chat(fault_svc, 2)[0]).status != 200:
        check_error(reply, 503)
        assert time.monotonic() < deadline, "chats kept failing after the engine restarted"
        time.sleep(0.5)
    for _ in range(3):
        reply, _ = chat(fault_svc, 2)
        assert reply.status == 200, reply.body
        assert reply.body["choices"][0]["message"]["role"] == "assistant"
