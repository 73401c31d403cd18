"""What the ingress (or any client) posts to the LLM engine's ``POST /v1/completions``.

OpenAI's completions body with epd's extensions: ``top_k``, ``ignore_eos``, ``stop_token_ids``
(sampling), ``return_token_ids`` (prompt and output ids in the choice), ``multimodal`` (one
``EmbeddingRef`` per media item, in prompt order) and ``kv_transfer`` (prefill/decode
disaggregation). Decoding is strict: a field of the wrong type is refused, and
``decode_completion_request`` names it as the error's ``param`` (``multimodal[i]`` for a bad
ref). A field that is absent or null takes the engine's default; what the types cannot say (value
ranges, n == 1, the prompt's shape) the engine checks after decoding. Unknown fields (``model``,
``user``, ...) are ignored.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import msgspec

from epd_common.messages.embedding_ref import EmbeddingRef

# A prompt: text, token ids, or a batch of one of either (true batches are separate requests).
# The list's items are typed loosely on purpose: the engine names a mixed list in its own words.
Prompt = str | list[int | str | list[int]]

# A KV export handle: a transport's own record (``llm_core.kv_transfer``), checked by the
# transport that reads it; a forged or stale one is recomputed, never refused.
KVHandle = dict[str, object]


class KVTransfer(msgspec.Struct, frozen=True, kw_only=True):
    """``{"export": true}``: hand the prompt's KV over after the prefill; ``{"import": handle,
    "first_token": id}``: take it in (or recompute the prompt when that fails)."""

    export: bool = False
    # UNSET when the body has no "import" (present but null is an import that falls back)
    handle: KVHandle | msgspec.UnsetType | None = msgspec.field(default=msgspec.UNSET, name="import")
    first_token: int | None = None


class StreamOptions(msgspec.Struct, frozen=True, kw_only=True):
    include_usage: bool | None = None


class CompletionRequestBody(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The body as decoded, or as the ingress builds it; UNSET: the field was absent (where absent
    and null differ). Encoded, a field at its default is left out."""

    prompt: Prompt | msgspec.UnsetType = msgspec.UNSET
    multimodal: list[EmbeddingRef] | None = None
    # absent: 16; null: as many as the model's context leaves
    max_tokens: int | msgspec.UnsetType | None = msgspec.UNSET
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    kv_transfer: KVTransfer | None = None
    # OpenAI fields the engine refuses unless they ask for what it does anyway
    n: int | None = 1
    echo: bool | None = None
    logprobs: int | bool | None = None
    best_of: int | None = None


class RequestBodyError(ValueError):
    """A body that is not JSON, not an object, or has a field of the wrong type; ``param`` names
    the field (None for the body as a whole)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


# msgspec ends a validation error with the path of the bad value: "... - at `$.multimodal[0].shape`"
_PATH = re.compile(r" - at `\$((?:\.\w+|\[\d+\])*)`$")
_FIELD = re.compile(r"\.(\w+)(\[\d+\])?")
# Fields whose items are named one by one when one is wrong (a client sends several refs).
_ITEM_FIELDS = frozenset({"multimodal"})

_DECODER = msgspec.json.Decoder(CompletionRequestBody)


def decode_completion_request(raw: bytes) -> CompletionRequestBody:
    """The body from its JSON bytes; ``RequestBodyError`` naming the field that is wrong."""
    try:
        return _DECODER.decode(raw)
    except msgspec.ValidationError as e:
        message, param = _describe(str(e))
        raise RequestBodyError(message, param) from e
    except msgspec.DecodeError as e:
        raise RequestBodyError(f"the body is not valid JSON: {e}", None) from e


def completion_request(fields: Mapping[str, object]) -> CompletionRequestBody:
    """The body from fields already decoded (the ingress's, or a client's JSON object);
    ``RequestBodyError`` naming the field that is wrong. Fields the Struct does not name are
    dropped, as the engine ignores them."""
    try:
        return msgspec.convert(fields, CompletionRequestBody)
    except msgspec.ValidationError as e:
        message, param = _describe(str(e))
        raise RequestBodyError(message, param) from e


def _describe(error: str) -> tuple[str, str | None]:
    """(message, param) of a msgspec validation error: the param is the top-level field, with the
    item's index for a field whose items are named (``multimodal[1]``)."""
    at = _PATH.search(error)
    path = at.group(1) if at else ""
    what = error[: at.start()] if at else error
    field = _FIELD.match(path)
    if field is None:  # the value at the root: the body itself
        return "the request body must be a JSON object", None
    name, index = field.group(1), field.group(2)
    param = name + index if index and name in _ITEM_FIELDS else name
    return f"'{path.lstrip('.')}': {what}", param
