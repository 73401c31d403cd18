"""JSON request bodies (epd/http.py): capped as they stream, parsed off the loop when big, and
every malformed one a 400 or 413 that says why (never a 500)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from starlette.requests import Request

from epd import http
from epd.http import MAX_DEPTH, read_json
from epd_common.errors import APIError


def _request(body: bytes, chunk: int = 1 << 16, declare: bool = True) -> Request:
    parts = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [
        {"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    headers = [(b"content-type", b"application/json")]
    if declare:
        headers.append((b"content-length", str(len(body)).encode()))
    return Request({"type": "http", "method": "POST", "headers": headers}, receive)


def _read(body: bytes, limit: int = 1 << 20, declare: bool = True) -> Any:
    return asyncio.run(read_json(_request(body, declare=declare), limit))


def _error(body: bytes, limit: int = 1 << 20, declare: bool = True) -> APIError:
    with pytest.raises(APIError) as info:
        _read(body, limit, declare)
    return info.value


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"{not json", "not valid JSON"),
        (b"1" + b"0" * 5000, "not valid JSON"),  # json.loads: ValueError -> a 500 before
        (b'{"max_tokens": 1e999}', "not valid JSON"),
        (b"[" * 30_000 + b"]" * 30_000, "deeper than"),
        (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "deeper than"),
        (b'{"a": ' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1), "deeper than"),
    ],
    ids=["malformed", "5000-digit-int", "inf", "30k-deep", "65-deep-lists", "65-deep-objects"],
)
def test_bad_bodies_are_400s_that_say_why(body: bytes, words: str) -> None:
    exc = _error(body)
    assert exc.status == 400 and words in exc.message


def test_the_depth_limit_admits_what_a_chat_needs() -> None:
    assert _read(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) is not None
    chat = b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}'
    assert _read(chat)["messages"][0]["content"][0]["image_url"]["url"] == "x"


def test_the_cap_applies_declared_and_streamed() -> None:
    body = b'{"a": "' + b"x" * 5000 + b'"}'
    assert _error(body, limit=4096).status == 413
    assert _error(body, limit=4096, declare=False).status == 413  # counted as it streams
    assert _read(body, limit=8192)["a"] == "x" * 5000


def test_a_big_body_is_parsed_on_a_worker_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[threading.Thread] = []
    real = http.parse_json

    def recording(raw: bytes) -> Any:
        threads.append(threading.current_thread())
        return real(raw)

    monkeypatch.setattr(http, "parse_json", recording)
    small = b'{"a": 1}'
    big = b'{"a": "' + b"x" * (http.OFF_LOOP_BYTES + 1) + b'"}'
    for body in (small, big):
        _read(body)
    assert threads[0] is threading.main_thread() and threads[1] is not threading.main_thread()


def test_too_many_objects_are_refused_before_any_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(raw: bytes) -> Any:
        raise AssertionError("parsed")

    monkeypatch.setattr(http.msgspec.json, "decode", never)
    body = b"[" + b",".join([b"[]"] * (http.MAX_CONTAINERS + 1)) + b"]"
    exc = _error(body, limit=64 << 20)
    assert exc.status == 413 and "objects and arrays" in exc.message
