"""Rendering a chat into prompt ids off the event loop, for the LLM servers that need the ids (epd's
engine takes them; a vLLM server is routed on them).

The chat template and the tokenizer run on a small thread pool: a long conversation takes
milliseconds to render, which every stream on the loop would wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from epd.llm_routing.page_naming import RoutingPrompt
from epd.llm_servers.cache_keys import routing_prompt
from epd.media_pipeline import EncodedItem
from epd.media_request import ChatMessage
from epd.prompt_format import ChatTemplateError, PromptFormat, prompt_media
from epd_common.errors import bad_request
from epd_common.messages.embedding_ref import EmbeddingRef

# Rendering threads: enough that one long prompt does not hold up the others, few because the
# work holds the GIL for most of its time.
PROMPT_THREADS = 4

T = TypeVar("T")


def render_chat(
    prompt_format: PromptFormat, messages: Sequence[ChatMessage], items: Sequence[EncodedItem]
) -> tuple[RoutingPrompt, list[EmbeddingRef]]:
    """A chat's prompt ids with its media spans, and the refs in the order their rows take the
    prompt's pads (call on a rendering thread)."""
    media, refs = prompt_media(messages, [it.ref for it in items])
    try:
        prompt_ids = prompt_format.prompt_ids(messages, media)
    except ChatTemplateError as exc:  # the checkpoint's template refused these messages
        raise bad_request(str(exc), exc.param) from exc
    routing = routing_prompt(
        prompt_format.tokenizer, prompt_ids, [(r.key, r.num_tokens, r.modality) for r in refs]
    )
    return routing, refs


class RenderPool:
    """The rendering threads of one LLM server."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="epd-prompt")

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
