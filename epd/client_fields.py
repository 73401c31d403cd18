"""Which fields a client may send to ``/v1/chat/completions`` and ``/v1/completions``, per LLM
server, and the bounds of the costly ones. Everything else is a 400 naming the field.

Why an allowlist: the completions body used to pass through to the server as it came, so a client
could set fields only epd itself may set (``kv_transfer`` made an engine export its prompt's KV,
to shared memory or, with Mooncake, to any host and port; ``prompt_embeds`` are tensors a
malformed one of which kills vLLM), or ask for work without bound (``n``, ``best_of``, a thousand
stop strings, a megabyte JSON schema).

    internal     kv_transfer, multimodal, prompt_embeds: set by epd, never taken from a client
    epd engines  OpenAI's fields the engine implements, plus top_k / ignore_eos / stop_token_ids /
                 return_token_ids; n, best_of: 1; echo: false; logprobs: none
    vLLM         the same plus the sampling and output fields vLLM documents for its OpenAI
                 server (penalties, min_p, logprobs, structured outputs, ...), bounded

``user`` is accepted and ignored on both. A chat's ``messages`` are checked by the media parser.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import msgspec

from epd_common.errors import bad_request, unprocessable

INTERNAL = frozenset({"kv_transfer", "multimodal", "prompt_embeds"})

_COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "stream",
        "stream_options",
        "return_token_ids",
        "n",
        "best_of",
        "echo",
        "logprobs",
        "user",
    }
)
_CHAT_ONLY = frozenset({"messages", "max_completion_tokens", "top_logprobs"})
_VLLM_EXTRA = frozenset(
    {
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "min_tokens",
        "logit_bias",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "include_stop_str_in_output",
        "response_format",
        "structured_outputs",
        "truncate_prompt_tokens",
        "prompt_logprobs",
    }
)

MAX_N = 1  # one choice: epd's answers, usage and relay are per choice
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 256
MAX_STOP_IDS = 64
MAX_LOGPROBS = 20  # vLLM's own default cap (--max-logprobs)
MAX_LOGIT_BIAS = 300  # OpenAI's
MAX_SCHEMA_CHARS = 64 * 1024  # a structured output's schema / grammar, as JSON


@functools.cache  # read on every chat (``chat_api._sampling``): four sets, built once
def allowed_fields(server: str, chat: bool) -> frozenset[str]:
    fields = _COMMON | (_CHAT_ONLY if chat else frozenset({"prompt"}))
    return fields | _VLLM_EXTRA if server == "vllm" else fields


def check_fields(body: Mapping[str, Any], server: str, chat: bool) -> None:
    """400 naming the first field a client may not send to this server's route; 422 naming one
    whose value asks for more than the bounds (or for what this server does not do)."""
    allowed = allowed_fields(server, chat)
    for name in body:
        if name in INTERNAL:
            raise bad_request(f"'{name}' is set by epd, never by a client", name)
        if name not in allowed:
            raise bad_request(
                f"'{name}' is not a field of this endpoint (with the {server} LLM server); "
                f"accepted: {', '.join(sorted(allowed))}",
                name,
            )
    _check_bounds(body, server)


def _check_bounds(body: Mapping[str, Any], server: str) -> None:
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None and value != 1 and not (isinstance(value, int) and 1 <= value <= MAX_N):
            raise unprocessable(f"'{name}' must be 1 (one choice per request), got {value!r}", name)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if len(stops) > MAX_STOP or any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in stops):
        raise unprocessable(f"at most {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters", "stop")
    ids = body.get("stop_token_ids")
    if isinstance(ids, list) and len(ids) > MAX_STOP_IDS:
        raise unprocessable(f"at most {MAX_STOP_IDS} stop_token_ids", "stop_token_ids")
    if body.get("echo") and server != "vllm":
        raise unprocessable("echo is not supported by epd's engine", "echo")
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        value = body.get(name)
        if value is None or value is False or (type(value) is int and value == 0):
            continue  # not asked for
        if server != "vllm":
            raise unprocessable("logprobs are not supported by epd's engine", name)
        if value is True and name == "logprobs":
            continue  # a chat's switch; its count is top_logprobs
        if type(value) is not int or not 0 <= value <= MAX_LOGPROBS:
            raise unprocessable(f"'{name}' must be an integer in [0, {MAX_LOGPROBS}], got {value!r}", name)
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > MAX_LOGIT_BIAS:
        raise unprocessable(f"at most {MAX_LOGIT_BIAS} logit_bias entries", "logit_bias")
    for name in ("response_format", "structured_outputs"):
        if name in body and len(msgspec.json.encode(body[name])) > MAX_SCHEMA_CHARS:
            raise unprocessable(f"'{name}' is over {MAX_SCHEMA_CHARS // 1024} KiB as JSON", name)
