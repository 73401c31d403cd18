"""What the LLM engine answers on ``POST /v1/completions``: the whole completion, or its SSE stream
of chunks (``data: <chunk>\\n\\n`` ... ``data: [DONE]\\n\\n``). OpenAI's shapes, plus
``token_ids`` / ``prompt_token_ids`` in a choice when the request asked ``return_token_ids`` and
``kv_transfer`` (what happened to the prompt's KV) when it carried one. A field left UNSET is not
written.
"""

from __future__ import annotations

import msgspec

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


# The KV hand-off's report (``llm_core.serving.kv_handoff``): an export's handle and sizes, or
# whether an import was taken in.
KVTransferInfo = dict[str, object]


class CompletionChunk(msgspec.Struct, kw_only=True):
    """One streamed event, or (with ``usage``) the whole answer."""

    id: str
    object: str = TEXT_COMPLETION
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | msgspec.UnsetType = msgspec.UNSET
    kv_transfer: KVTransferInfo | msgspec.UnsetType = msgspec.UNSET


_ENCODER = msgspec.json.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    """The JSON of a response message."""
    return _ENCODER.encode(message)


def sse_event(message: msgspec.Struct) -> bytes:
    """One SSE event carrying ``message``."""
    return b"data: " + _ENCODER.encode(message) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
