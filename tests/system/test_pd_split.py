"""Prefill/decode split (``--llm-prefill-instances 1 --llm-decode-instances 1``) through the real
service: greedy ids equal a co-located engine's, with images and prefix hits; the KV moved is the
layer plan's; a forged or corrupted handle and a killed engine never lose a request."""

from __future__ import annotations

import base64
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.epd.conftest import Reply, ServeProcess, http_json, image_bytes, photo, request, start_serve
from tests.system.conftest import check_error, child_pids, pid_alive, shm_entries, stop_checked, wait_until

RESTART_TIMEOUT_S = 150.0
CLIENT_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def pd_svc() -> Iterator[ServeProcess]:
    before = shm_entries("serve-")
    server = start_serve(
        [
            "--llm-prefill-instances",
            "1",
            "--llm-decode-instances",
            "1",
            "--llm-torch-threads",
            "1",
            "--health-interval-s",
            "0.3",
        ]
    )
    try:
        yield server
    finally:
        stop_checked(server, before)


def data_uri(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(image_bytes(photo(64, 48, seed), "PNG")).decode()


def chats() -> list[list[dict[str, Any]]]:
    system = {"role": "system", "content": "Answer in one short sentence. " * 12}
    image = {"type": "image_url", "image_url": {"url": data_uri(31)}}
    return [
        [system, {"role": "user", "content": "What is a page table?"}],
        [system, {"role": "user", "content": "What is a radix tree?"}],  # the system prompt hits
        [system, {"role": "user", "content": [image, {"type": "text", "text": "Describe it."}]}],
    ]


def ask(server: ServeProcess, messages: list[dict[str, Any]], max_tokens: int = 12) -> Reply:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True}
    return request("POST", f"{server.url}/v1/chat/completions", body, timeout=CLIENT_TIMEOUT_S)


def ids(reply: Reply) -> list[int]:
    assert reply.status == 200, reply.body
    return list(reply.body["choices"][0]["token_ids"])


def engine_url(server: ServeProcess, role: str) -> str:
    (url,) = [u for u, r in zip(*engine_roles(server), strict=True) if r == role]
    return url


def engine_roles(server: ServeProcess) -> tuple[list[str], list[str]]:
    urls, roles = [], []
    for pid in child_pids(server.proc.pid, "llm"):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        urls.append(f"http://127.0.0.1:{argv[argv.index('--port') + 1]}")
        roles.append(argv[argv.index("--role") + 1])
    return urls, roles


def engine_pid(server: ServeProcess, role: str) -> int | None:
    """The live ``role`` engine's pid (None between a kill and the restart)."""
    for pid in child_pids(server.proc.pid, "llm"):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if argv[argv.index("--role") + 1] == role:
            return pid
    return None


def handoff(url: str) -> dict[str, Any]:
    status, body = http_json("GET", f"{url}/health?check_integrity=1")
    assert status == 200 and body["integrity"] == "ok", body
    return dict(body["kv_handoff"])


@pytest.mark.timeout(300)
def test_split_equals_colocated_with_images_and_prefix_hits(pd_svc: ServeProcess, svc: ServeProcess) -> None:
    expected = [ids(ask(svc, m)) for m in chats()]
    decode = engine_url(pd_svc, "decode")
    before = handoff(decode)["imported"]
    got = []
    for m in chats() + chats():  # the second round hits the prefill engine's prefix cache
        reply = ask(pd_svc, m)
        got.append(ids(reply))
    assert got == expected + expected
    assert handoff(decode)["imported"] - before == 6 and handoff(decode)["fallbacks"] == {}
    assert handoff(engine_url(pd_svc, "prefill"))["exported"] >= 6
    _, metrics = http_json("GET", f"{pd_svc.url}/metrics")
    text = metrics.decode() if isinstance(metrics, bytes) else str(metrics)
    moved = [ln for ln in text.splitlines() if ln.startswith("epd_llm_kv_transfer_bytes_total")]
    assert moved and float(moved[0].split()[-1]) > 0, moved


def test_a_forged_or_corrupted_handle_is_recomputed_with_the_same_answer(pd_svc: ServeProcess) -> None:
    decode = engine_url(pd_svc, "decode")
    prompt = list(range(40, 90))
    plain = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    status, want = http_json("POST", f"{decode}/v1/completions", plain)
    assert status == 200, want
    # a real export from the prefill engine, then its checksum flipped on the way
    prefill = engine_url(pd_svc, "prefill")
    status, pre = http_json(
        "POST", f"{prefill}/v1/completions", {**plain, "max_tokens": 1, "kv_transfer": {"export": True}}
    )
    assert status == 200 and "handle" in pre["kv_transfer"], pre
    first = pre["choices"][0]["token_ids"][0]
    handle = dict(pre["kv_transfer"]["handle"])
    handle["xxh3"] = f"{int(handle['xxh3'], 16) ^ 0xFF:016x}"
    forged = [handle, {**handle, "id": "../../etc/passwd"}, {"transport": "shm", "id": "0" * 32}]
    for h in forged:
        status, out = http_json(
            "POST", f"{decode}/v1/completions", {**plain, "kv_transfer": {"import": h, "first_token": first}}
        )
        assert status == 200, out
        assert out["kv_transfer"]["imported"] is False, out["kv_transfer"]
        assert out["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    handoff(decode)  # integrity holds


def _healthy(url: str) -> bool:
    try:
        return http_json("GET", f"{url}/health", timeout=2.0)[0] == 200
    except OSError:
        return False


def kill_and_check(server: ServeProcess, role: str) -> None:
    """kill -9 the ``role`` engine while chats are in flight and keep sending: every chat completes
    or gets a clean 503 within its timeout; the engine restarts and split chats work again."""
    pid = engine_pid(server, role)
    assert pid is not None
    replies: list[tuple[Reply, float]] = []

    def one(i: int) -> None:
        t0 = time.perf_counter()
        r = ask(server, [{"role": "user", "content": f"chat {i} " + "and more " * 20}], max_tokens=40)
        replies.append((r, time.perf_counter() - t0))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), 10, f"the killed {role} engine to be reaped")
    late = [threading.Thread(target=one, args=(10 + i,), daemon=True) for i in range(2)]
    for t in late:
        t.start()
    for t in threads + late:
        t.join(CLIENT_TIMEOUT_S + 5)
        assert not t.is_alive(), "a chat hung after an engine died"
    for reply, seconds in replies:
        if reply.status != 200:
            check_error(reply, 503)
        assert seconds < CLIENT_TIMEOUT_S
    wait_until(lambda: engine_pid(server, role) not in (None, pid), RESTART_TIMEOUT_S, f"a new {role} engine")
    url = engine_url(server, role)
    wait_until(lambda: _healthy(url), RESTART_TIMEOUT_S, "the restarted engine's health", interval_s=0.5)
    decode = engine_url(server, "decode")
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:  # the ingress's view lags one health poll; then split chats import again
        before = handoff(decode)["imported"]
        reply = ask(server, [{"role": "user", "content": f"after the {role} restart"}])
        if reply.status == 200 and handoff(decode)["imported"] > before:
            break
        assert time.monotonic() < deadline, f"split chats did not come back after the {role} restart"
        time.sleep(0.5)
    handoff(engine_url(server, "prefill"))


@pytest.mark.timeout(400)
def test_kill9_decode_engine_mid_request(pd_svc: ServeProcess) -> None:
    kill_and_check(pd_svc, "decode")


@pytest.mark.timeout(400)
def test_kill9_prefill_engine_falls_back_to_decode_prefill(pd_svc: ServeProcess) -> None:
    kill_and_check(pd_svc, "prefill")
