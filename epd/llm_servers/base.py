"""What every language-model server gives the chat path: typed calls, results and deltas."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import aiohttp

from epd.engine_body import EngineBody
from epd.engine_client import EngineClient
from epd.llm_routing.page_naming import RoutingPrompt
from epd.media_pipeline import EncodedItem
from epd.media_request import ChatMessage


class ChatCall(NamedTuple):
    """One request as a server of this kind takes it."""

    path: str  # the server's endpoint, e.g. "/v1/completions"
    body: EngineBody  # epd's engine request Struct, or the server kind's own JSON
    # the prompt's ids and media spans as the server sees them, which the router names pages
    # from (``epd.llm_routing.page_naming``); empty when the server kind routes by load only
    routing: RoutingPrompt
    prompt_tokens: int | None = None  # the prompt's size for load counting, when routing is empty
    # the server streams OpenAI chat chunks, which the chat route relays as bytes (only the usage
    # chunk is decoded); else each chunk goes through ``chat_delta``
    relay: bool = False


class ChatResult(NamedTuple):
    """A whole answer."""

    text: str
    finish_reason: str | None
    usage: dict[str, Any]
    prompt_token_ids: list[int] | None = None  # when the request asked return_token_ids
    token_ids: list[int] | None = None


class ChatDelta(NamedTuple):
    """One streamed piece: text, the end (finish_reason) and/or the usage."""

    text: str
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


class LLMServer(Protocol):
    """How chats and completions reach one kind of language-model server."""

    name: str
    # The media modalities it hands to its server (the ingress drops the model's others: a part of
    # one gets 415 naming the server kind)
    modalities: frozenset[str]
    # policies the router may use over this server kind's servers (affinity needs KV events or the
    # engine's own page geometry)
    routing_policies: tuple[str, ...]
    # whether servers must pass ``check_server`` before anything is routed to them (and again each
    # time they come back up)
    checks_servers: bool

    def client(self, session: aiohttp.ClientSession, url: str, timeout_s: float) -> EngineClient:
        """The HTTP client of one server."""
        ...

    async def check_server(self, client: EngineClient) -> None:
        """Refuse (``ServerMismatch`` naming the field) a server this deployment cannot use."""
        ...

    async def chat_call(
        self, messages: Sequence[ChatMessage], items: Sequence[EncodedItem], sampling: dict[str, Any]
    ) -> ChatCall:
        """``messages``: parts ``{"type": "text", "text"}`` or ``{"type": "image" | "video", "index"}``
        (``items[index]`` resolved); raises APIError for what this server kind cannot send. Rendering
        the prompt (chat template, tokenizer) happens off the event loop."""
        ...

    async def completion_call(self, body: dict[str, Any]) -> ChatCall:
        """A ``/v1/completions`` body as this server kind's server takes it (tokenizing, if any, off
        the event loop)."""
        ...

    async def close(self) -> None:
        """Release what the server kind opened (HTTP sessions)."""
        ...

    def chat_result(self, out: dict[str, Any]) -> ChatResult: ...

    def chat_delta(self, chunk: dict[str, Any]) -> ChatDelta: ...


class ServerMismatch(RuntimeError):
    """A server does not serve what this deployment's encoders produce (architecture, hidden size,
    embeddings input turned off): start-up stops with this message."""
