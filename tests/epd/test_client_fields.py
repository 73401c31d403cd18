"""What a client may send to the chat and completions routes (epd/client_fields.py): internal
fields never, unknown fields never, costly ones bounded; per backend."""

from __future__ import annotations

from typing import Any

import pytest

from epd.client_fields import INTERNAL, MAX_LOGPROBS, MAX_SCHEMA_CHARS, MAX_STOP, allowed_fields, check_fields
from epd_common.errors import APIError
from tests.epd.conftest import ServeProcess, http_json

BACKENDS = ("epd", "vllm")


def _refused(body: dict[str, Any], backend: str, chat: bool) -> APIError:
    """400 for a field that may not be sent, 422 for a value past the bounds."""
    with pytest.raises(APIError) as info:
        check_fields(body, backend, chat)
    assert info.value.status in (400, 422)
    return info.value


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("field", sorted(INTERNAL))
def test_internal_fields_are_never_taken_from_a_client(backend: str, chat: bool, field: str) -> None:
    exc = _refused({field: {"export": True}}, backend, chat)
    assert exc.status == 400 and exc.param == field and "set by epd" in exc.message


@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_fields_are_named(backend: str) -> None:
    exc = _refused({"prompt": "x", "tools": []}, backend, chat=False)
    assert exc.param == "tools" and "accepted:" in exc.message
    assert _refused({"messages": [], "prompt": "x"}, backend, chat=True).param == "prompt"
    # vLLM's sampling fields are for vLLM only
    if backend == "epd":
        assert (
            _refused({"prompt": "x", "presence_penalty": 0.5}, backend, chat=False).param
            == "presence_penalty"
        )
    else:
        check_fields({"prompt": "x", "presence_penalty": 0.5, "min_p": 0.1}, backend, chat=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_costly_fields_are_bounded(backend: str) -> None:
    for body in ({"n": 2}, {"best_of": 3}, {"n": "2"}):
        _refused(body, backend, chat=False)
    check_fields({"n": 1, "best_of": 1, "user": "u"}, backend, chat=False)
    assert _refused({"stop": ["s"] * (MAX_STOP + 1)}, backend, chat=False).param == "stop"
    assert _refused({"stop": "x" * 300}, backend, chat=True).param == "stop"
    assert _refused({"stop_token_ids": list(range(65))}, backend, chat=False).param == "stop_token_ids"
    check_fields({"stop": ["a", "b"], "stop_token_ids": [1, 2]}, backend, chat=False)


def test_logprobs_and_structured_outputs_per_backend() -> None:
    assert _refused({"logprobs": 2}, "epd", chat=False).param == "logprobs"
    assert _refused({"logprobs": True}, "epd", chat=True).param == "logprobs"
    check_fields({"logprobs": 0}, "epd", chat=False)
    check_fields({"logprobs": True, "top_logprobs": 5}, "vllm", chat=True)
    check_fields({"logprobs": MAX_LOGPROBS}, "vllm", chat=False)
    assert _refused({"logprobs": MAX_LOGPROBS + 1}, "vllm", chat=False).param == "logprobs"
    assert _refused({"top_logprobs": 1000}, "vllm", chat=True).param == "top_logprobs"
    schema = {"type": "json_schema", "json_schema": {"schema": {"description": "x" * MAX_SCHEMA_CHARS}}}
    assert _refused({"response_format": schema}, "vllm", chat=True).param == "response_format"
    check_fields({"response_format": {"type": "json_object"}}, "vllm", chat=True)
    assert "response_format" not in allowed_fields("epd", chat=True)


def test_a_served_completion_refuses_a_clients_kv_transfer(epd_server: ServeProcess) -> None:
    """Through HTTP: the engine would export the prompt's KV on a client's word; now a 400, and
    the server still answers."""
    url = f"{epd_server.url}/v1/completions"
    status, body = http_json("POST", url, {"prompt": "hi", "max_tokens": 2, "kv_transfer": {"export": True}})
    assert status == 400 and body["error"]["param"] == "kv_transfer", body
    status, body = http_json("POST", url, {"prompt": "hi", "max_tokens": 2, "n": 3})
    assert status == 422 and body["error"]["param"] == "n", body
    status, body = http_json("POST", url, {"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] is not None, body
