"""epd's own engine (``epd llm``) as a backend: the ingress renders the prompt ids with the
checkpoint's chat template and sends EmbeddingRefs; the engine reads the embeddings itself.

The chat template and the tokenizer run on a small thread pool of the backend's, off the event
loop: a long conversation takes milliseconds to render, which every stream on the loop would wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import aiohttp

from epd.engine_client import EngineClient
from epd.llm_backends.base import ChatCall, ChatDelta, ChatResult
from epd.llm_backends.cache_keys import prompt_cache_keys
from epd.media_pipeline import EncodedItem
from epd.prompt_format import ChatTemplateError, PromptFormat, prompt_media
from epd_common.errors import bad_request
from epd_common.messages.embedding_ref import EmbeddingRef

COMPLETIONS = "/v1/completions"
# Rendering threads: enough that one long prompt does not hold up the others, few because the
# work holds the GIL for most of its time.
PROMPT_THREADS = 4

T = TypeVar("T")


class EpdEngineBackend:
    name = "epd"
    modalities: frozenset[str] = frozenset({"image", "video", "audio"})
    routing_policies: tuple[str, ...] = ("affinity", "round_robin", "least_load")
    checks_servers = False  # `epd serve` started them from the same checkpoint

    def __init__(self, prompt_format: PromptFormat) -> None:
        self.prompt_format = prompt_format
        self._render_pool = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="epd-prompt")

    async def _off_loop(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._render_pool, fn)

    def client(self, session: aiohttp.ClientSession, url: str, timeout_s: float) -> EngineClient:
        return EngineClient(session, url, timeout_s=timeout_s)

    async def check_server(self, client: EngineClient) -> None:
        return None  # our engines report their model in /health; the supervisor started them

    async def chat_call(
        self, messages: Sequence[Mapping[str, Any]], items: Sequence[EncodedItem], sampling: dict[str, Any]
    ) -> ChatCall:
        prompt_ids, refs, keys = await self._off_loop(partial(self._render, messages, items))
        # the refs go as Structs: the engine client encodes the body with msgspec
        body = {"prompt": prompt_ids, "multimodal": refs, **sampling}
        return ChatCall(COMPLETIONS, body, keys)

    def _render(
        self, messages: Sequence[Mapping[str, Any]], items: Sequence[EncodedItem]
    ) -> tuple[list[int], list[EmbeddingRef], list[int]]:
        """Prompt ids, the refs the engine gets (in the order their rows take the prompt's pads)
        and the cache keys of a chat (a rendering thread)."""
        media, refs = prompt_media(messages, [it.ref for it in items])
        try:
            prompt_ids = self.prompt_format.prompt_ids(messages, media)
        except ChatTemplateError as exc:  # the checkpoint's template refused these messages
            raise bad_request(str(exc), exc.param) from exc
        keys = prompt_cache_keys(
            self.prompt_format.tokenizer, prompt_ids, [(r.key, r.num_tokens, r.modality) for r in refs]
        )
        return prompt_ids, refs, keys

    async def completion_call(self, body: dict[str, Any]) -> ChatCall:
        """A text prompt is tokenized for its cache keys on a rendering thread."""
        prompt = body.get("prompt")
        keys = await self._off_loop(partial(prompt_cache_keys, self.prompt_format.tokenizer, prompt))
        return ChatCall(COMPLETIONS, body, keys)

    async def close(self) -> None:
        self._render_pool.shutdown(wait=False, cancel_futures=True)

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
