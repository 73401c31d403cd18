"""vLLM's token-in route, ``POST /inference/v1/generate`` (vLLM 0.32, on with ``--enable-scale-out``;
a 403 otherwise): epd renders and tokenizes the chat itself and sends ids.

What that buys over the chat route: request text stays text (epd's tokenization masks every
special a user spells; vLLM's chat route reads them as control tokens), vLLM's API server renders
no template and tokenizes nothing, and the ids the router names blocks from are the ids vLLM runs.

    {"token_ids": [...],                                the prompt, placeholders expanded
     "sampling_params": {vLLM's own names},             max_tokens, temperature, stop, ...
     "features": {"mm_hashes": {"image": [MediaKey]},                    the block-hash identifiers
                  "mm_placeholders": {"image": [{"offset", "length"}]},  each item's pad run
                  "kwargs_data": {"image": [base64 msgpack item]}},      its embedding and grid
     "output_mode": "text", "stream": ..., "stream_options": ...}

An item is vLLM's ``MultiModalKwargsItem`` as its msgpack encoder writes it (``vllm/v1/serial_utils``):
each field ``{"data": [dtype, shape, Ext(3, little-endian bytes)], "field": [kind, options]}``;
Qwen2.5-VL's image is ``image_embeds`` (flat, [rows, hidden]) and ``image_grid_thw`` (batched, kept
on CPU). Videos keep the chat route (their item needs ``second_per_grid_ts``, not wired here).
The answer has ``choices[0].text`` (``output_mode: "text"``) and ``token_ids``; a stream's chunks
carry the text delta of each step.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from epd.llm_routing.page_naming import RoutingPrompt
from epd.llm_servers.base import ChatDelta, ChatResult
from epd_common.messages.embedding_ref import EmbeddingRef

GENERATE = "/inference/v1/generate"
_TENSOR_EXT = 3  # vLLM's msgpack extension code of a raw tensor

# chat body field -> vLLM SamplingParams field (the rest of a chat body is not sampling)
SAMPLING_NAMES = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens",
    "top_logprobs": "logprobs",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output",
}
# what the token route cannot do that a chat body may ask (the chat route serves those)
CHAT_ONLY = frozenset({"response_format", "structured_outputs", "logit_bias", "logprobs", "prompt_logprobs"})


def _tensor(t: torch.Tensor) -> list[Any]:
    array = t.detach().cpu().contiguous().numpy()
    return [
        str(t.dtype).removeprefix("torch."),
        list(array.shape),
        msgspec.msgpack.Ext(_TENSOR_EXT, array.tobytes()),
    ]


def image_item(embedding: torch.Tensor, grid_thw: Sequence[int]) -> str:
    """One image as vLLM's token route takes it: base64 of the msgpack item (embedding [rows,
    hidden], checked by the caller; its grid in patches)."""
    rows = int(embedding.shape[0])
    item = {
        "image_embeds": {
            "data": _tensor(embedding),
            "field": ["flat", {"keep_on_cpu": False, "slices": [[[0, rows, None]]], "dim": 0}],
        },
        "image_grid_thw": {
            "data": _tensor(torch.from_numpy(np.asarray(grid_thw, dtype=np.int64))),
            "field": ["batched", {"keep_on_cpu": True}],
        },
    }
    return base64.b64encode(msgspec.msgpack.encode(item)).decode("ascii")


def sampling_params(sampling: Mapping[str, Any]) -> dict[str, Any]:
    """A chat's sampling fields in vLLM's names; text is detokenized for ``output_mode: "text"``."""
    out = {SAMPLING_NAMES[k]: v for k, v in sampling.items() if k in SAMPLING_NAMES}
    return {**out, "detokenize": True}


def generate_body(
    routing: RoutingPrompt,
    refs: Sequence[EmbeddingRef],
    items: Mapping[str, str],
    sampling: Mapping[str, Any],
) -> dict[str, Any]:
    """The request: ``routing``'s ids and spans (one span per image), ``items[key]`` each image's
    encoded item (``image_item``), in the order the refs take the prompt's pads."""
    spans = sorted(routing.media, key=lambda s: s.start)
    body: dict[str, Any] = {
        "token_ids": list(routing.token_ids),
        "sampling_params": sampling_params(sampling),
        "output_mode": "text",
    }
    if sampling.get("return_token_ids"):
        body["return_token_ids"] = True
    if spans:
        keys = [refs[s.item].key for s in spans]
        body["features"] = {
            "mm_hashes": {"image": keys},
            "mm_placeholders": {"image": [{"offset": s.start, "length": s.length} for s in spans]},
            "kwargs_data": {"image": [items[k] for k in keys]},
        }
    return body


def result(out: dict[str, Any]) -> ChatResult:
    choice = out["choices"][0]
    usage = out.get("usage") or {}
    return ChatResult(
        text=choice.get("text") or "",
        finish_reason=choice.get("finish_reason"),
        usage={k: v for k, v in usage.items() if v is not None},
        prompt_token_ids=out.get("prompt_token_ids"),
        token_ids=choice.get("token_ids"),
    )


def delta(chunk: dict[str, Any]) -> ChatDelta:
    text, finish = "", None
    for choice in chunk.get("choices") or []:
        text += choice.get("text") or ""
        finish = choice.get("finish_reason") or finish
    usage = chunk.get("usage")
    return ChatDelta(text, finish, {k: v for k, v in usage.items() if v is not None} if usage else None)
