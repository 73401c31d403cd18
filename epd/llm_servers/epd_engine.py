"""epd's own engine (``epd llm``) as an LLM server: the ingress renders the prompt ids with the
checkpoint's chat template and sends EmbeddingRefs; the engine reads the embeddings itself.

The chat template and the tokenizer run off the event loop (``render``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import aiohttp

from epd.engine_client import EngineClient
from epd.llm_servers.base import ChatCall, ChatDelta, ChatResult
from epd.llm_servers.cache_keys import routing_prompt
from epd.llm_servers.render import RenderPool, render_chat
from epd.media_pipeline import EncodedItem
from epd.prompt_format import PromptFormat

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
        self, messages: Sequence[Mapping[str, Any]], items: Sequence[EncodedItem], sampling: dict[str, Any]
    ) -> ChatCall:
        routing, refs = await self._render.run(partial(render_chat, self.prompt_format, messages, items))
        # the refs go as Structs: the engine client encodes the body with msgspec
        body = {"prompt": list(routing.token_ids), "multimodal": refs, **sampling}
        return ChatCall(COMPLETIONS, body, routing)

    async def completion_call(self, body: dict[str, Any]) -> ChatCall:
        """A text prompt is tokenized for its routing on a rendering thread."""
        prompt = body.get("prompt")
        routing = await self._render.run(partial(routing_prompt, self.prompt_format.tokenizer, prompt))
        return ChatCall(COMPLETIONS, body, routing)

    async def close(self) -> None:
        self._render.close()

    def chat_result(self, out: dict[str, Any], call: ChatCall) -> ChatResult:
        choice = out["choices"][0]
        return ChatResult(
            text=choice.get("text", ""),
            finish_reason=choice.get("finish_reason"),
            usage=dict(out.get("usage") or {}),
            prompt_token_ids=choice.get("prompt_token_ids"),
            token_ids=choice.get("token_ids"),
        )

    def chat_delta(self, chunk: dict[str, Any], call: ChatCall) -> ChatDelta:
        text, finish = "", None
        for choice in chunk.get("choices", []):
            text += choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
        return ChatDelta(text, finish, chunk.get("usage") or None)
