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
     "output_mode": "tokens" | "text", "stream": ..., "stream_options": ...}

An item is vLLM's ``MultiModalKwargsItem`` as its msgpack encoder writes it (``vllm/v1/serial_utils``):
each field ``{"data": [dtype, shape, Ext(3, little-endian bytes)], "field": [kind, options]}``;
Qwen2.5-VL's image is ``image_embeds`` (flat, [rows, hidden]) and ``image_grid_thw`` (batched, kept
on CPU). Videos keep the chat route (their item needs ``second_per_grid_ts``, not wired here).
The answer has ``choices[0].token_ids``; a stream's chunks carry each step's ids.

Who detokenizes: epd, where it decodes as vLLM would (``epd_decodes``): vLLM answers ids
(``output_mode: "tokens"``, ``detokenize: false``) and ``AnswerText`` turns them into text on the
ingress, with the tokenizers DecodeStream primed with the prompt, the stop token left out: vLLM's
own detokenizer's rules. That takes the per-token decoding off vLLM's API server, the one process
every request of the server passes. Stop strings (matched on vLLM's text), logprobs (decoded token
strings) and special tokens spaced apart keep ``output_mode: "text"``.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from epd.llm_routing.page_naming import RoutingPrompt
from epd.llm_servers.base import ChatDelta, ChatResult, IdsToText
from epd_common.messages.embedding_ref import EmbeddingRef
from llm_core.prompts.tokenizer import Tokenizer

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


def epd_decodes(sampling: Mapping[str, Any]) -> bool:
    """Whether epd can turn the answer's ids into the text vLLM would send: not when stop strings
    cut that text, logprobs carry decoded tokens, or kept special tokens are spaced as vLLM's slow
    path does."""
    if sampling.get("stop") or "top_logprobs" in sampling:
        return False
    return bool(
        sampling.get("skip_special_tokens", True) or sampling.get("spaces_between_special_tokens", True)
    )


def sampling_params(sampling: Mapping[str, Any], detokenize: bool = True) -> dict[str, Any]:
    """A chat's sampling fields in vLLM's names; ``detokenize``: vLLM writes the text."""
    out = {SAMPLING_NAMES[k]: v for k, v in sampling.items() if k in SAMPLING_NAMES}
    return {**out, "detokenize": detokenize}


def generate_body(
    routing: RoutingPrompt,
    refs: Sequence[EmbeddingRef],
    items: Mapping[str, str],
    sampling: Mapping[str, Any],
    ids_only: bool = False,
) -> dict[str, Any]:
    """The request: ``routing``'s ids and spans (one span per image), ``items[key]`` each image's
    encoded item (``image_item``), in the order the refs take the prompt's pads. ``ids_only``: vLLM
    answers ids, which epd decodes (``AnswerText``)."""
    spans = sorted(routing.media, key=lambda s: s.start)
    body: dict[str, Any] = {
        "token_ids": list(routing.token_ids),
        "sampling_params": sampling_params(sampling, detokenize=not ids_only),
        "output_mode": "tokens" if ids_only else "text",
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


class AnswerText:
    """One answer's text from the ids vLLM sends (``output_mode: "tokens"``), by vLLM's own
    detokenizer's rules: each id decoded after the prompt (``Tokenizer.primed_decoder``), and the
    id that ended a ``"stop"`` answer (eos or a stop token id; stop strings never come here) left
    out unless ``include_stop_str_in_output``. Cost: ~1 us an id, on the event loop."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], sampling: Mapping[str, Any]) -> None:
        self._decoder = tokenizer.primed_decoder(prompt_ids, bool(sampling.get("skip_special_tokens", True)))
        self._keep_stop = bool(sampling.get("include_stop_str_in_output"))

    def add(self, ids: Sequence[int], finish_reason: str | None) -> str:
        """The text ``ids`` (the next step's, or the whole answer's) add."""
        if finish_reason == "stop" and not self._keep_stop:
            ids = ids[:-1]
        return "".join([self._decoder.add(i) for i in ids])


def _text(choice: Mapping[str, Any], answer: IdsToText | None) -> str:
    if answer is None or "text" in choice:
        return choice.get("text") or ""
    return answer.add(choice.get("token_ids") or [], choice.get("finish_reason"))


def result(out: dict[str, Any], answer: IdsToText | None) -> ChatResult:
    """The answer; ``answer``: the call's decoder when vLLM was asked for ids."""
    choice = out["choices"][0]
    usage = out.get("usage") or {}
    return ChatResult(
        text=_text(choice, answer),
        finish_reason=choice.get("finish_reason"),
        usage={k: v for k, v in usage.items() if v is not None},
        prompt_token_ids=out.get("prompt_token_ids"),
        token_ids=choice.get("token_ids"),
    )


def delta(chunk: dict[str, Any], answer: IdsToText | None) -> ChatDelta:
    text, finish = "", None
    for choice in chunk.get("choices") or []:
        text += _text(choice, answer)
        finish = choice.get("finish_reason") or finish
    usage = chunk.get("usage")
    return ChatDelta(text, finish, {k: v for k, v in usage.items() if v is not None} if usage else None)
