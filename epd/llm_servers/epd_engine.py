"""epd's own engine (``epd llm``) as an LLM server: the ingress renders the prompt ids with the
checkpoint's chat template and sends EmbeddingRefs; the engine reads the embeddings itself.

The chat template and the tokenizer run off the event loop (``render``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import aiohttp
import msgspec

from epd.engine_client import EngineClient
from epd.llm_servers.base import ChatCall, ChatDelta, ChatResult
from epd.llm_servers.cache_keys import routing_prompt
from epd.llm_servers.render import RenderPool, render_chat
from epd.media_pipeline import EncodedItem
from epd.media_request import ChatMessage
from epd.prompt_format import PromptFormat
from epd_common.errors import APIError, bad_request
from epd_common.messages.completion_request import CompletionRequestBody, RequestBodyError, completion_request
from epd_common.messages.completion_response import CompletionChunk

COMPLETIONS = "/v1/completions"


class EpdEngineServer:
    name = "epd"
    modalities: frozenset[str] = frozenset({"image", "video", "audio"})
    routing_policies: tuple[str, ...] = ("affinity", "round_robin", "least_load")
    checks_servers = False  # `epd serve` started them from the same checkpoint

    def __init__(self, prompt_format: PromptFormat) -> None:
        self.prompt_format = prompt_format
        self._render = RenderPool()

    def client(self, session: aiohttp.ClientSession, url: str, timeout_s: float) -> EngineClient:
        return EngineClient(session, url, timeout_s=timeout_s)

    async def check_server(self, client: EngineClient) -> None:
        return None  # our engines report their model in /health; the supervisor started them

    async def chat_call(
        self, messages: Sequence[ChatMessage], items: Sequence[EncodedItem], sampling: dict[str, Any]
    ) -> ChatCall:
        routing, refs = await self._render.run(partial(render_chat, self.prompt_format, messages, items))
        body = _request({**sampling, "prompt": list(routing.token_ids), "multimodal": refs})
        return ChatCall(COMPLETIONS, body, routing)

    async def completion_call(self, body: dict[str, Any]) -> ChatCall:
        """A text prompt is tokenized for its routing on a rendering thread."""
        request = _request(body)
        prompt = None if request.prompt is msgspec.UNSET else request.prompt
        routing = await self._render.run(partial(routing_prompt, self.prompt_format.tokenizer, prompt))
        return ChatCall(COMPLETIONS, request, routing)

    async def close(self) -> None:
        self._render.close()

    def chat_result(self, out: dict[str, Any]) -> ChatResult:
        answer = _answer(out)
        choice = answer.choices[0]
        return ChatResult(
            text=choice.text,
            finish_reason=choice.finish_reason,
            usage=_usage(answer),
            prompt_token_ids=_ids(choice.prompt_token_ids),
            token_ids=_ids(choice.token_ids),
        )

    def chat_delta(self, chunk: dict[str, Any]) -> ChatDelta:
        answer = _answer(chunk)
        text, finish = "", None
        for choice in answer.choices:
            text += choice.text
            finish = choice.finish_reason or finish
        return ChatDelta(text, finish, _usage(answer) or None)


def _request(fields: Mapping[str, Any]) -> CompletionRequestBody:
    """The engine's request Struct (the refs are Structs already); 400 naming a field of the
    wrong type before any engine is asked."""
    try:
        return completion_request(fields)
    except RequestBodyError as exc:
        raise bad_request(str(exc), exc.param) from exc


def _answer(out: dict[str, Any]) -> CompletionChunk:
    """The engine's answer (or one streamed chunk) in the schema it was written in."""
    try:
        return msgspec.convert(out, CompletionChunk)
    except msgspec.ValidationError as exc:
        raise APIError(
            502, f"the LLM engine sent an answer that is not a completion: {exc}", type="upstream_error"
        ) from exc


def _usage(answer: CompletionChunk) -> dict[str, Any]:
    return {} if answer.usage is msgspec.UNSET else msgspec.to_builtins(answer.usage)  # type: ignore[no-any-return]


def _ids(ids: list[int] | msgspec.UnsetType) -> list[int] | None:
    return None if ids is msgspec.UNSET else ids
