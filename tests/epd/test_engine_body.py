"""The body a request goes to an LLM server as (epd/engine_body.py): epd's engine Struct and a
server kind's own dict read and set the fields every kind shares alike; the Struct is encoded as
the engine decodes it."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from epd.engine_body import EngineBody, includes_usage, max_tokens, streamed, with_usage
from epd.llm_servers.epd_engine import EpdEngineServer
from epd_common.errors import APIError
from epd_common.messages.completion_request import (
    CompletionRequestBody,
    RequestBodyError,
    completion_request,
    decode_completion_request,
)

FIELDS: dict[str, Any] = {"prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0.0}


@pytest.mark.parametrize("body", [completion_request(FIELDS), dict(FIELDS)], ids=["struct", "dict"])
def test_both_kinds_read_and_set_the_shared_fields(body: EngineBody) -> None:
    assert max_tokens(body) == 5 and not includes_usage(body)
    asked = with_usage(streamed(body, True))
    assert includes_usage(asked) and max_tokens(asked) == 5
    assert msgspec.json.decode(msgspec.json.encode(asked))["stream"] is True
    assert not includes_usage(body)  # the original is untouched


def test_unset_and_null_max_tokens_differ() -> None:
    """Absent: the engine's default (16); null: what the context leaves. The Struct keeps both."""
    absent, null = (
        completion_request({"prompt": [1]}),
        completion_request({"prompt": [1], "max_tokens": None}),
    )
    assert max_tokens(absent) is None and max_tokens(null) is None
    assert "max_tokens" not in msgspec.json.decode(msgspec.json.encode(absent))
    assert decode_completion_request(msgspec.json.encode(null)).max_tokens is None
    assert decode_completion_request(msgspec.json.encode(absent)).max_tokens is msgspec.UNSET


def test_the_engine_decodes_what_the_ingress_encodes() -> None:
    body = completion_request(
        {**FIELDS, "stop": ["x"], "stream_options": {"include_usage": True}, "user": "u"}
    )
    assert decode_completion_request(msgspec.json.encode(body)) == body
    assert isinstance(body, CompletionRequestBody)


def test_a_wrong_type_is_named_before_any_engine_is_asked() -> None:
    with pytest.raises(RequestBodyError) as ei:
        completion_request({"prompt": [1], "temperature": "hot"})
    assert ei.value.param == "temperature"
    server = EpdEngineServer.__new__(EpdEngineServer)
    with pytest.raises(APIError) as api:
        asyncio.run(server.completion_call({"prompt": [1], "top_k": "many"}))
    assert api.value.status == 400 and api.value.param == "top_k"
