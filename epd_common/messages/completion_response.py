"""What the LLM engine answers on ``POST /v1/completions``: the whole completion, or its SSE stream
of chunks (``data: <chunk>\\n\\n`` ... ``data: [DONE]\\n\\n``). OpenAI's shapes, plus
``token_ids`` / ``prompt_token_ids`` in a choice when the request asked ``return_token_ids`` and
``kv_transfer`` (what happened to the prompt's KV) when it carried one. A field left UNSET is not
written.
"""

from __future__ import annotations

import msgspec

from epd_common.messages.completion_request import KVHandle

TEXT_COMPLETION = "text_completion"


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int = 0  # prompt tokens served by the prefix cache


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    """OpenAI's usage block; ``prompt_tokens_details.cached_tokens``: prompt tokens served by the
    prefix cache (a router compares it with what it predicted)."""
    return Usage(
        prompt_tokens,
        completion_tokens,
        prompt_tokens + completion_tokens,
        PromptTokensDetails(cached_tokens),
    )


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None  # "stop" | "length" | "abort" while running; None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class KVTransferReport(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What happened to the prompt's KV (``llm_core.serving.kv_handoff``; the ingress's P/D
    hand-off, ``epd.engine_pool``, reads it): a prefill engine's export, its ``handle`` and sizes
    or the ``error`` that stopped it; or a decode engine's import, ``imported`` and, when the
    prompt was recomputed instead, the ``reason``."""

    handle: KVHandle | None = None
    error: str | None = None
    imported: bool | None = None
    reason: str | None = None
    bytes: int = 0  # moved over the transport
    kv_bytes: int = 0  # of KV in them
    seconds: float = 0.0


def kv_transfer_report(value: object) -> KVTransferReport | None:
    """An answer's ``kv_transfer`` as decoded JSON -> the report; None when absent or not one (a
    hand-off that cannot be read is one that did not happen: the prompt is recomputed)."""
    if value is None:
        return None
    try:
        return msgspec.convert(value, KVTransferReport)
    except msgspec.ValidationError:
        return None


class CompletionChunk(msgspec.Struct, kw_only=True):
    """One streamed event, or (with ``usage``) the whole answer."""

    id: str
    object: str = TEXT_COMPLETION
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | msgspec.UnsetType = msgspec.UNSET
    kv_transfer: KVTransferReport | msgspec.UnsetType = msgspec.UNSET


_ENCODER = msgspec.json.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    """The JSON of a response message."""
    return _ENCODER.encode(message)


def sse_event(message: msgspec.Struct) -> bytes:
    """One SSE event carrying ``message``."""
    return b"data: " + _ENCODER.encode(message) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
