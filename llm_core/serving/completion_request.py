"""``POST /v1/completions`` bodies into typed requests, and the response messages.

The body is decoded strictly into ``epd_common.messages.completion_request.CompletionRequestBody``
(a field of the wrong type is a 400 naming it); this module checks what the types cannot say
(value ranges, n == 1, the prompt's shape and size) and tokenizes the prompt. A string prompt is
text, like a chat message: a special token spelled in it is tokenized as its characters
(``Tokenizer.encode_text``); a prompt of token ids is taken as given. Every problem is an
``APIError`` naming the offending field, so the client sees which part of its body was wrong.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass

import msgspec

from epd_common.errors import bad_request
from epd_common.messages.completion_request import (
    CompletionRequestBody,
    KVTransfer,
    Prompt,
    RequestBodyError,
    decode_completion_request,
)
from epd_common.messages.completion_response import CompletionChoice, CompletionChunk, usage
from epd_common.messages.embedding_ref import EmbeddingRef
from llm_core.prompts.tokenizer import Tokenizer
from llm_core.serving.sampling import SamplingParams, SamplingParamsError

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

MAX_STOP_STRINGS = 16
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class CompletionRequest:
    """A validated completion request (prompt already tokenized)."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stream: bool
    return_token_ids: bool
    refs: tuple[EmbeddingRef, ...]
    include_usage: bool
    created: int
    kv_transfer: KVTransfer | None = None


def _parse_prompt(prompt: Prompt | msgspec.UnsetType, tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    if prompt is msgspec.UNSET:
        raise bad_request("'prompt' is required", "prompt")
    # A batch of one is accepted in either spelling; true batches belong to separate requests.
    one = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else None
    single: str | list[int] | list[int | str | list[int]] = one if isinstance(one, str | list) else prompt
    if isinstance(single, str):
        ids = tokenizer.encode_text(single)  # text, like a chat message: no special ids from it
    elif all(isinstance(t, int) for t in single):  # the decoder refused bools
        ids = [t for t in single if isinstance(t, int)]
        # Ids are checked against the model's vocabulary: a checkpoint without tokenizer.json
        # uses the byte-level tokenizer, which knows fewer ids than the model embeds.
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token ids must be in [0, {vocab_size}), got {bad[:5]}", "prompt")
    else:
        raise bad_request(
            "'prompt' must be a string or a list of token ids (one prompt per request)", "prompt"
        )
    if not ids:
        raise bad_request("'prompt' is empty", "prompt")
    return ids


def _parse_stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", "stop")
    return tuple(stops)


def _check_unsupported(body: CompletionRequestBody) -> None:
    """What the engine does not do is refused; asking for the default is not (``n`` null is 1, a
    chat's ``logprobs: false`` asks for none)."""
    if body.n not in (None, 1):
        raise bad_request(f"only n=1 is supported, got {body.n}", "n")
    if body.echo:
        raise bad_request("echo is not supported", "echo")
    if body.logprobs is not None and body.logprobs is not False:
        raise bad_request("logprobs are not supported", "logprobs")
    if body.best_of not in (None, 1):
        raise bad_request("best_of is not supported", "best_of")


def _max_tokens(body: CompletionRequestBody, prompt_len: int, max_model_len: int) -> int:
    room = max_model_len - prompt_len
    if room < 1:
        raise bad_request(f"the prompt has {prompt_len} tokens; the limit is {max_model_len - 1}", "prompt")
    max_tokens = DEFAULT_MAX_TOKENS if body.max_tokens is msgspec.UNSET else body.max_tokens
    if max_tokens is None:
        return room
    if max_tokens > room:
        raise bad_request(
            f"max_tokens={max_tokens} + prompt {prompt_len} tokens exceeds max_model_len={max_model_len}",
            "max_tokens",
        )
    return max_tokens


def parse_completion_request(
    raw: bytes, tokenizer: Tokenizer, max_model_len: int, vocab_size: int, request_id: str | None = None
) -> CompletionRequest:
    """Decode and validate a completions body (its JSON bytes); raises ``APIError`` (400) naming
    the bad field.

    ``request_id``: the caller's id for the request (the ``X-Request-Id`` header; a router matches
    it against the engine's /health ``request_ids``); a fresh one when absent."""
    try:
        body = decode_completion_request(raw)
    except RequestBodyError as e:
        raise bad_request(str(e), e.param) from e
    if request_id is not None and not _REQUEST_ID.fullmatch(request_id):
        raise bad_request("X-Request-Id must be 1-128 characters of [A-Za-z0-9._:-]", "X-Request-Id")
    _check_unsupported(body)
    prompt_ids = _parse_prompt(body.prompt, tokenizer, vocab_size)
    max_tokens = _max_tokens(body, len(prompt_ids), max_model_len)
    try:
        sampling = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if body.top_k is None else body.top_k,
            seed=body.seed,
            max_tokens=max_tokens,
            stop=_parse_stop(body.stop),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=bool(body.ignore_eos),
        )
    except SamplingParamsError as e:
        raise bad_request(str(e), e.param) from e
    return CompletionRequest(
        request_id=request_id or f"cmpl-{uuid.uuid4().hex}",
        prompt_ids=prompt_ids,
        sampling=sampling,
        stream=bool(body.stream),
        return_token_ids=bool(body.return_token_ids),
        refs=tuple(body.multimodal or ()),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        created=int(time.time()),
        kv_transfer=body.kv_transfer,
    )


def _choice(text: str, finish_reason: str | None) -> CompletionChoice:
    return CompletionChoice(text=text, finish_reason=finish_reason)


def completion_body(
    req: CompletionRequest,
    model: str,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    cached_tokens: int = 0,
) -> CompletionChunk:
    """The non-streaming response."""
    choice = _choice(text, finish_reason)
    if req.return_token_ids:
        choice.prompt_token_ids = req.prompt_ids
        choice.token_ids = token_ids
    return CompletionChunk(
        id=req.request_id,
        created=req.created,
        model=model,
        choices=[choice],
        usage=usage(len(req.prompt_ids), len(token_ids), cached_tokens),
    )


def chunk_body(
    req: CompletionRequest,
    model: str,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    first: bool,
) -> CompletionChunk:
    """One SSE chunk; the prompt ids ride on the first chunk when ``return_token_ids``."""
    choice = _choice(text, finish_reason)
    if req.return_token_ids:
        choice.token_ids = token_ids
        if first:
            choice.prompt_token_ids = req.prompt_ids
    return CompletionChunk(id=req.request_id, created=req.created, model=model, choices=[choice])
