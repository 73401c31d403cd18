"""Parsing of ``POST /v1/completions`` bodies into typed requests, and the response bodies.

OpenAI completions semantics with three extensions: ``top_k``/``ignore_eos``/``stop_token_ids``
(sampling), ``return_token_ids`` (prompt and output ids in the choice) and ``multimodal`` (a list
of EmbeddingRef JSON objects, one per placeholder run of the prompt, in order). A string prompt is
text, like a chat message: a special token spelled in it is tokenized as its characters
(``Tokenizer.encode_text``); a prompt of token ids is taken as given. Every problem is an
``APIError`` naming the offending field, so the client sees which part of its body was wrong.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from epd_common.errors import APIError, bad_request
from epd_common.messages.embedding_ref import EmbeddingRef
from llm_core.prompts.tokenizer import Tokenizer
from llm_core.serving.sampling import SamplingParams, SamplingParamsError

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")

MAX_STOP_STRINGS = 16


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


def _type_error(param: str, want: str, got: object) -> APIError:
    return bad_request(f"'{param}' must be {want}, got {type(got).__name__} {got!r:.80}", param)


def _get_int(body: dict[str, Any], name: str, default: int | None) -> int | None:
    v = body.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _type_error(name, "an integer", v)
    return v


def _get_float(body: dict[str, Any], name: str, default: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _type_error(name, "a number", v)
    return float(v)


def _get_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def _parse_prompt(body: dict[str, Any], tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    if "prompt" not in body:
        raise bad_request("'prompt' is required", "prompt")
    prompt = body["prompt"]
    # A batch of one is accepted in either spelling; true batches belong to separate requests.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode_text(prompt)  # text, like a chat message: no special ids from it
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
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


def _parse_stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _type_error("stop", "a string or a list of strings", stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", "stop")
    return tuple(stop)


def _parse_ids(body: dict[str, Any], name: str) -> tuple[int, ...]:
    v = body.get(name)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise _type_error(name, "a list of integers", v)
    return tuple(v)


def _parse_refs(body: dict[str, Any]) -> tuple[EmbeddingRef, ...]:
    items = body.get("multimodal")
    if items is None:
        return ()
    if not isinstance(items, list):
        raise _type_error("multimodal", "a list of EmbeddingRef objects", items)
    refs = []
    for i, item in enumerate(items):
        param = f"multimodal[{i}]"
        if not isinstance(item, dict):
            raise _type_error(param, "an EmbeddingRef object", item)
        try:
            refs.append(EmbeddingRef.from_json(item))
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise bad_request(f"not a valid EmbeddingRef: {type(e).__name__}: {e}", param) from e
    return tuple(refs)


def parse_completion_request(
    body: Any, tokenizer: Tokenizer, max_model_len: int, vocab_size: int, request_id: str | None = None
) -> CompletionRequest:
    """Validate a completions body; raises ``APIError`` (400) naming the bad field.

    ``request_id``: the caller's id for the request (the ``X-Request-Id`` header; a router matches
    it against the engine's /health ``request_ids``); a fresh one when absent."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None)
    if request_id is not None and not _REQUEST_ID.fullmatch(request_id):
        raise bad_request("X-Request-Id must be 1-128 characters of [A-Za-z0-9._:-]", "X-Request-Id")
    n = _get_int(body, "n", 1)
    if n != 1:
        raise bad_request(f"only n=1 is supported, got {n}", "n")
    if _get_bool(body, "echo", False):
        raise bad_request("echo is not supported", "echo")
    if body.get("logprobs") is not None:
        raise bad_request("logprobs are not supported", "logprobs")
    if body.get("best_of") not in (None, 1):
        raise bad_request("best_of is not supported", "best_of")
    prompt_ids = _parse_prompt(body, tokenizer, vocab_size)
    max_tokens = _get_int(body, "max_tokens", 16)
    room = max_model_len - len(prompt_ids)
    if room < 1:
        raise bad_request(
            f"the prompt has {len(prompt_ids)} tokens; the limit is {max_model_len - 1}", "prompt"
        )
    if max_tokens is None:
        max_tokens = room
    if max_tokens > room:
        raise bad_request(
            f"max_tokens={max_tokens} + prompt {len(prompt_ids)} tokens exceeds max_model_len={max_model_len}",
            "max_tokens",
        )
    top_k = _get_int(body, "top_k", 0)
    try:
        sampling = SamplingParams(
            temperature=_get_float(body, "temperature", 1.0),
            top_p=_get_float(body, "top_p", 1.0),
            top_k=0 if top_k is None else top_k,
            seed=_get_int(body, "seed", None),
            max_tokens=max_tokens,
            stop=_parse_stop(body),
            stop_token_ids=_parse_ids(body, "stop_token_ids"),
            ignore_eos=_get_bool(body, "ignore_eos", False),
        )
    except SamplingParamsError as e:
        raise bad_request(str(e), e.param) from e
    stream = _get_bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    return CompletionRequest(
        request_id=request_id or f"cmpl-{uuid.uuid4().hex}",
        prompt_ids=prompt_ids,
        sampling=sampling,
        stream=stream,
        return_token_ids=_get_bool(body, "return_token_ids", False),
        refs=_parse_refs(body),
        include_usage=include_usage,
        created=int(time.time()),
    )


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage block; ``prompt_tokens_details.cached_tokens``: prompt tokens served by the
    prefix cache (a router compares it with what it predicted)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    req: CompletionRequest,
    model: str,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    cached_tokens: int = 0,
) -> dict[str, Any]:
    """The non-streaming response body."""
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if req.return_token_ids:
        choice["prompt_token_ids"] = req.prompt_ids
        choice["token_ids"] = token_ids
    return {
        "id": req.request_id,
        "object": "text_completion",
        "created": req.created,
        "model": model,
        "choices": [choice],
        "usage": usage(len(req.prompt_ids), len(token_ids), cached_tokens),
    }


def chunk_body(
    req: CompletionRequest,
    model: str,
    text: str,
    token_ids: list[int],
    finish_reason: str | None,
    first: bool,
) -> dict[str, Any]:
    """One SSE chunk; the prompt ids ride on the first chunk when ``return_token_ids``."""
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if req.return_token_ids:
        choice["token_ids"] = token_ids
        if first:
            choice["prompt_token_ids"] = req.prompt_ids
    return {
        "id": req.request_id,
        "object": "text_completion",
        "created": req.created,
        "model": model,
        "choices": [choice],
    }
