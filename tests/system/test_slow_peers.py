"""Slow peers: neither a slow origin nor a slow client holds up anyone else.

- A media URL that trickles its bytes hits the download timeout (``--fetch-total-timeout-s``, short
  on ``svc``) and gets 504, while uploads sent at the same time complete promptly.
- A client that opens a streamed chat, reads one chunk and then stops reading (a tiny receive
  buffer makes the back-pressure real) or hangs up does not block the engine: other chats
  complete promptly meanwhile and afterwards.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.epd.conftest import Reply, ServeProcess, multipart, request, unique_png
from tests.fixtures.media_server import MediaServer
from tests.system.conftest import SVC_FETCH_TOTAL_TIMEOUT_S, check_error

PROMPT_S = 20.0  # "promptly" on a loaded 2-core machine: far below the stalled stream's lifetime


def _encode_upload(svc: ServeProcess) -> tuple[Reply, float]:
    t0 = time.perf_counter()
    reply = request("POST", f"{svc.url}/v1/encode", *multipart([("p.png", unique_png(), "image/png")]))
    return reply, time.perf_counter() - t0


def _chat(svc: ServeProcess, max_tokens: int = 4) -> tuple[Reply, float]:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": max_tokens}
    t0 = time.perf_counter()
    reply = request("POST", f"{svc.url}/v1/chat/completions", body, timeout=60)
    return reply, time.perf_counter() - t0


@pytest.mark.timeout(90)
def test_trickling_origin_times_out_without_holding_up_others(svc: ServeProcess, origin: MediaServer) -> None:
    # 200 kB at 1 kB every 0.2 s: 40 s to finish, far past the download timeout.
    slow_url = origin.url("/trickle?bytes=200000&chunk=1000&interval=0.2")
    encode = f"{svc.url}/v1/encode"
    with ThreadPoolExecutor(8) as pool:
        t0 = time.perf_counter()
        slow = [
            pool.submit(
                lambda: (request("POST", encode, {"items": [{"url": slow_url}]}), time.perf_counter())
            )
            for _ in range(3)
        ]
        time.sleep(0.3)  # the slow downloads are under way
        fast = [pool.submit(_encode_upload, svc) for _ in range(4)]
        for f in fast:
            reply, seconds = f.result(timeout=60)
            assert reply.status == 200, reply.body
            assert seconds < PROMPT_S, f"an upload took {seconds:.1f} s behind trickling downloads"
        for f in slow:
            reply, done = f.result(timeout=60)
            check_error(reply, 504, "items[0]")
            assert done - t0 < SVC_FETCH_TOTAL_TIMEOUT_S + 10, f"the timeout fired after {done - t0:.1f} s"
    assert request("GET", f"{svc.url}/health").status == 200


def _open_stream(svc: ServeProcess, max_tokens: int) -> tuple[socket.socket, bytes]:
    """Start a streamed chat on a raw socket with a tiny receive buffer; return it after the first
    SSE chunk arrived (and the bytes read so far)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", svc.port))
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": max_tokens,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{svc.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    got = b""
    while b"data: " not in got.split(b"\r\n\r\n", 1)[-1]:
        chunk = sock.recv(512)
        assert chunk, f"the stream closed before its first chunk: {got!r}"
        got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    return sock, got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["stall", "close"])
def test_client_that_stops_reading_a_stream_does_not_block_the_engine(svc: ServeProcess, how: str) -> None:
    assert _chat(svc)[0].status == 200  # warm
    sock, _ = _open_stream(svc, max_tokens=2000)
    try:
        if how == "close":
            sock.close()
        # The stalled (or vanished) reader must not hold the engine: other chats and encodes go on.
        results: list[tuple[Reply, float]] = []
        workers = [threading.Thread(target=lambda: results.append(_chat(svc))) for _ in range(3)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(PROMPT_S * 2)
            assert not w.is_alive(), "a chat hung while another client stalled its stream"
        for reply, seconds in results:
            assert reply.status == 200, reply.body
            assert seconds < PROMPT_S, f"a chat took {seconds:.1f} s while a stream was stalled"
        reply, seconds = _encode_upload(svc)
        assert reply.status == 200 and seconds < PROMPT_S, (reply.status, seconds)
    finally:
        sock.close()
    # After the stalled client is gone, the service still answers streams and plain chats.
    reply, seconds = _chat(svc)
    assert reply.status == 200 and seconds < PROMPT_S, (reply.body, seconds)
