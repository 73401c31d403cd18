"""epd's own engine (``epd llm``) as a backend: the ingress renders the prompt ids with the
checkpoint's chat template and sends EmbeddingRefs; the engine reads the embeddings itself."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from epd.engine_client import EngineClient
from epd.llm_backends.base import ChatCall, ChatDelta, ChatResult
from epd.llm_backends.cache_keys import prompt_cache_keys
from epd.media_pipeline import EncodedItem
from epd.prompt_format import ChatTemplateError, PromptFormat, media_item
from epd_common.errors import bad_request

COMPLETIONS = "/v1/completions"


class EpdEngineBackend:
    name = "epd"
    routing_policies: tuple[str, ...] = ("affinity", "round_robin", "least_load")
    checks_servers = False  # `epd serve` started them from the same checkpoint

    def __init__(self, prompt_format: PromptFormat) -> None:
        self.prompt_format = prompt_format

    def client(self, session: aiohttp.ClientSession, url: str, timeout_s: float) -> EngineClient:
        return EngineClient(session, url, timeout_s=timeout_s)

    async def check_server(self, client: EngineClient) -> None:
        return None  # our engines report their model in /health; the supervisor started them

    async def chat_call(
        self, messages: Sequence[Mapping[str, Any]], items: Sequence[EncodedItem], sampling: dict[str, Any]
    ) -> ChatCall:
        media = [media_item(items[p["index"]].ref) for m in messages for p in m["content"] if "index" in p]
        try:
            prompt_ids = self.prompt_format.prompt_ids(messages, media)
        except ChatTemplateError as exc:  # the checkpoint's template refused these messages
            raise bad_request(str(exc), exc.param) from exc
        body = {"prompt": prompt_ids, "multimodal": [it.ref.to_json() for it in items], **sampling}
        keys = prompt_cache_keys(
            self.prompt_format.tokenizer, prompt_ids, [(it.ref.key, it.ref.num_tokens) for it in items]
        )
        return ChatCall(COMPLETIONS, body, keys)

    def completion_call(self, body: dict[str, Any]) -> ChatCall:
        return ChatCall(
            COMPLETIONS, body, prompt_cache_keys(self.prompt_format.tokenizer, body.get("prompt"))
        )

    async def close(self) -> None:
        return None

    def chat_result(self, out: dict[str, Any]) -> ChatResult:
        choice = out["choices"][0]
        return ChatResult(
            text=choice.get("text", ""),
            finish_reason=choice.get("finish_reason"),
            usage=dict(out.get("usage") or {}),
            prompt_token_ids=choice.get("prompt_token_ids"),
            token_ids=choice.get("token_ids"),
        )

    def chat_delta(self, chunk: dict[str, Any]) -> ChatDelta:
        text, finish = "", None
        for choice in chunk.get("choices", []):
            text += choice.get("text") or ""
            finish = choice.get("finish_reason") or finish
        return ChatDelta(text, finish, chunk.get("usage") or None)
