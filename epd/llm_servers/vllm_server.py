"""vLLM as the language-model server: epd encodes, vLLM generates.

The chat goes to each server's ``/v1/chat/completions`` as chat messages (vLLM renders its own
chat template): text parts unchanged, each media item an ``image_embeds`` / ``video_embeds`` part
(``vllm_embeds``) read from the node cache (or the encoder's URL), checked, and keyed by its
MediaKey. Completions pass through to its ``/v1/completions``. Which media go as embeddings is the
model family's launch profile (``epd_common.checkpoint.vllm_profile``): images and videos by
default, images only for MiMo-V2.5; the ingress refuses the others (415) before anything is sent.

At start each server is asked what it serves (``check_server``): its ``/v1/models`` names the
model and its path; where that path's config.json is readable here, the architecture (or the class
vLLM loads it as: MiMo-V2.5 is ``MiMoV2OmniForCausalLM`` there) and the hidden size must equal the
checkpoint the encoders serve; then a one-row embedding of the right width (harmless) tells whether
the server takes embeddings at all (``--enable-mm-embeds``).

With an ``ECFolder`` (``--vllm-ec-path DIR``, ``vllm_ec``) each checked embedding is written to
``DIR/<MediaKey>/encoder_cache.safetensors`` instead, and the part carries only its grid and uuid;
the start-up check then also makes sure the server reads that folder (else a part would kill it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

import aiohttp
import torch

from encoder.caches.embed_cache import EmbedCache
from epd.engine_body import EngineBody
from epd.engine_client import EngineClient
from epd.llm_routing.page_naming import RoutingPrompt
from epd.llm_servers import vllm_tokens
from epd.llm_servers.base import ChatCall, ChatDelta, ChatResult, ServerMismatch
from epd.llm_servers.render import RenderPool, render_chat
from epd.llm_servers.vllm_ec import ECFolder, ec_transfer_config, metadata_keys, metadata_part
from epd.llm_servers.vllm_embeds import (
    EmbeddingGeometry,
    EmbeddingMismatch,
    check_embedding,
    check_seconds,
    embeds_part,
    tensor_b64,
)
from epd.llm_servers.vllm_routing import KVEventsAt, routing_health
from epd.llm_servers.vllm_tokens import CHAT_ONLY, GENERATE, generate_body, image_item
from epd.media_pipeline import EncodedItem
from epd.media_request import ChatMessage
from epd.prompt_format import PromptFormat
from epd_common.checkpoint.config_json import read_config_json
from epd_common.checkpoint.errors import CheckpointError
from epd_common.checkpoint.registry import find_architecture, vllm_profile
from epd_common.checkpoint.vllm_profile import DEFAULT_VLLM, VLLMProfile
from epd_common.errors import APIError, bad_request
from llm_core.prompts.request_text import mask_chat
from llm_core.request import MultimodalInput
from llm_core.serving.embedding_source import EmbeddingSource

log = logging.getLogger("epd.llm_servers.vllm")

CHAT = "/v1/chat/completions"
ROUTES = ("auto", "chat", "tokens")
COMPLETIONS = "/v1/completions"
# Above this many bytes an embedding is serialized off the event loop.
_OFF_LOOP_BYTES = 1 << 20


class ModelInfo:
    """What the checkpoint the encoders serve hands a language model: its architecture, hidden
    size, the tower's spatial merge (from config.json) and how vLLM serves its family."""

    def __init__(
        self, architecture: str, geometry: EmbeddingGeometry, profile: VLLMProfile = DEFAULT_VLLM
    ) -> None:
        self.architecture = architecture
        self.geometry = geometry
        self.profile = profile

    @classmethod
    def of(cls, model_dir: str | Path) -> ModelInfo:
        config = read_config_json(Path(model_dir))
        arch, hidden = _arch_and_hidden(config)
        vision = config.get("vision_config") or {}
        merge = int(vision.get("spatial_merge_size", 2))
        return cls(arch, EmbeddingGeometry(merge, hidden), vllm_profile(config))

    def same_architecture(self, arch: str) -> bool:
        """Whether a server's config.json architecture is this one: the same name, or a name of the
        same registry row (the class vLLM loads it as, ``VLLMProfile.served_as``)."""
        if arch == self.architecture:
            return True
        mine = find_architecture({"architectures": [self.architecture]})
        return mine is not None and mine is find_architecture({"architectures": [arch]})


def _arch_and_hidden(config: Mapping[str, Any]) -> tuple[str, int]:
    archs = config.get("architectures") or ["?"]
    text = config.get("text_config") or {}
    hidden = text.get("hidden_size", config.get("hidden_size"))
    if not isinstance(hidden, int):
        raise CheckpointError("config.json has no hidden_size (nor text_config.hidden_size)")
    return str(archs[0]), hidden


class VLLMClient(EngineClient):
    """One vLLM server; requests name the model it serves (learnt from its /v1/models)."""

    model_id: str | None = None
    large_bodies = True  # inline embeddings
    ec: ECFolder | None = None  # the encoder-cache folder the metadata-only parts name
    # what the router needs of this server beside its /health (``vllm_routing.routing_health``)
    routing_health: Mapping[str, Any] = MappingProxyType({})
    token_route: bool | None = None  # whether it serves /inference/v1/generate (None: not asked yet)

    async def health(self, timeout_s: float = 2.0) -> dict[str, Any] | None:
        """vLLM's /health (an empty 200) with the server's page geometry and event stream."""
        body = await super().health(timeout_s)
        return None if body is None else {**body, **self.routing_health}

    def prepare(self, body: EngineBody) -> EngineBody:
        if not isinstance(body, dict):  # vLLM takes its own JSON, never epd's engine Struct
            raise TypeError(f"a vLLM server is sent a dict body, not {type(body).__name__}")
        if self.ec is not None and (keys := metadata_keys(body)) and not self.ec.mark_used(keys):
            # vLLM's engine would die on it: fail this request instead (a retry writes it again)
            raise APIError(
                502,
                "an embedding file of this request was removed from the encoder-cache folder before "
                "it was sent; retry",
                type="embedding_missing",
            )
        return {**body, "model": self.model_id} if self.model_id else body

    def raise_for_status(self, resp: aiohttp.ClientResponse, payload: dict[str, Any]) -> None:
        """vLLM answers 500 when a request broke its engine (which then exits): that request is
        answered 502 and not sent to the next server (it might break that one too); the server,
        once unreachable, is taken out by the next call or health round."""
        if resp.status >= 500 and resp.status != 503:
            err = payload.get("error") if isinstance(payload.get("error"), dict) else {}
            message = str((err or {}).get("message", "")) or f"HTTP {resp.status}"
            log.warning("vLLM at %s failed request: %s", self.base_url, message)
            raise APIError(502, f"{self.label} (vLLM) failed this request: {message}", type="upstream_error")
        super().raise_for_status(resp, payload)


class VLLMServer:
    name = "vllm"
    # the media handed on as embeddings: the family's profile's (the default's, images and videos;
    # images for MiMo-V2.5), set per instance; audio is not wired (nor a video's sound track)
    modalities: frozenset[str] = DEFAULT_VLLM.embeds
    # affinity: by the server's own KV events, its block hashes recomputed (``vllm_routing``)
    routing_policies: tuple[str, ...] = ("affinity", "round_robin", "least_load")
    checks_servers = True  # a server of another model or without embeddings input would die

    def __init__(
        self,
        prompt_format: PromptFormat,
        model: ModelInfo,
        cache: EmbedCache | None,
        ec: ECFolder | None = None,
        kv_events: Mapping[str, KVEventsAt | None] | None = None,
        block_size: int = 128,
        render_routes: bool = False,
        route: str = "auto",
    ) -> None:
        """``kv_events``: each server's event stream (by url); ``render_routes``: render each chat's
        prompt ids here for the router even on the chat route (where vLLM renders its own copy);
        ``route``: "tokens" (``vllm_tokens``: epd renders, vLLM's token-in route), "chat" (its
        /v1/chat/completions), or "auto" (tokens when every server checked so far serves it)."""
        if route not in ROUTES:
            raise ValueError(f"--vllm-route must be one of {ROUTES}, got {route!r}")
        self.prompt_format = prompt_format
        self.model = model
        self.modalities = model.profile.embeds
        self.cache = cache
        self.ec = ec  # None: the embeddings go inline (the default)
        self.source = EmbeddingSource(cache, model.geometry.hidden)  # the node cache, else ref.url
        self.kv_events = dict(kv_events or {})
        self.block_size = block_size
        self.render_routes = render_routes
        self.route = route
        self._render = RenderPool()
        self._clients: list[VLLMClient] = []

    def client(self, session: aiohttp.ClientSession, url: str, timeout_s: float) -> EngineClient:
        client = VLLMClient(session, url, timeout_s=timeout_s)
        client.ec = self.ec
        client.routing_health = routing_health(self.kv_events.get(url), self.block_size)
        self._clients.append(client)
        return client

    @property
    def token_route(self) -> bool:
        """Whether chats go by the token route now: asked for, or (auto) every server that has
        been checked serves it (a request may land on any of them)."""
        if self.route != "auto":
            return self.route == "tokens"
        return bool(self._clients) and all(c.token_route for c in self._clients)

    # -- start-up ------------------------------------------------------------------------------
    async def check_server(self, client: EngineClient) -> None:
        """Raise ``ServerMismatch`` naming the field when the server at ``client`` cannot take
        this deployment's embeddings; ``ConnectionError`` when it does not answer."""
        assert isinstance(client, VLLMClient)
        models = await client.get_json("/v1/models")
        if not models or not models.get("data"):
            raise ConnectionError(f"{client.base_url}/v1/models did not answer")
        served = models["data"][0]
        client.model_id = str(served.get("id"))
        root = served.get("root") or served.get("id")
        try:
            arch, hidden = _arch_and_hidden(read_config_json(Path(str(root))))
        except (CheckpointError, OSError):
            log.warning(
                "vLLM at %s serves %s, whose config.json is not readable here: its architecture and "
                "hidden size are not checked (and embeddings input is checked on the first request)",
                client.base_url,
                root,
            )
            if self.ec is not None:
                log.warning(
                    "vLLM at %s is not checked to read %s either: a part whose file it cannot find "
                    "stops its engine",
                    client.base_url,
                    self.ec.root,
                )
            return
        if not self.model.same_architecture(arch):
            raise ServerMismatch(
                f"vLLM at {client.base_url} serves architecture {arch} ({root}); the encoders serve "
                f"{self.model.architecture}"
            )
        if hidden != self.model.geometry.hidden:
            raise ServerMismatch(
                f"vLLM at {client.base_url} serves hidden_size {hidden} ({root}); the encoders' "
                f"embeddings are {self.model.geometry.hidden} wide"
            )
        await self._probe_embeds(client)
        if self.ec is not None:
            await self._probe_ec(client)
        await self._probe_tokens(client)

    def _probe_body(self, uuid_: str | None = None) -> dict[str, Any]:
        """A harmless request: one zero row of the right width for the smallest grid."""
        m = self.model.geometry.merge
        payload = {"image_embeds": _zeros_b64(self.model.geometry.hidden), "image_grid_thw": [1, m, m]}
        part: dict[str, Any] = {"type": "image_embeds", "image_embeds": payload}
        if uuid_ is not None:
            part["uuid"] = uuid_
        return {"messages": [{"role": "user", "content": [part]}], "max_tokens": 1, "temperature": 0}

    async def _probe_embeds(self, client: EngineClient) -> None:
        """The server takes a one-row embedding of the right width and grid."""
        try:
            await client.complete(self._probe_body(), path=CHAT)
        except APIError as exc:
            if "enable-mm-embeds" in exc.message:
                raise ServerMismatch(
                    f"vLLM at {client.base_url} was started without --enable-mm-embeds: it refuses "
                    f"precomputed embeddings ({exc.message})"
                ) from exc
            raise ServerMismatch(f"vLLM at {client.base_url} refused an embedding: {exc.message}") from exc

    async def _probe_tokens(self, client: VLLMClient) -> None:
        """Whether the server serves the token route (``--enable-scale-out``): one token of one
        prompt id. Asked for (``--vllm-route tokens``) and absent: the start stops."""
        if self.route == "chat":
            client.token_route = False
            return
        try:
            await client.complete({"token_ids": [0], "sampling_params": {"max_tokens": 1}}, path=GENERATE)
            client.token_route = True
        except APIError as exc:
            client.token_route = False
            if self.route == "tokens":
                raise ServerMismatch(
                    f"vLLM at {client.base_url} does not serve the token route {GENERATE} ({exc.message}): "
                    "start it with --enable-scale-out, or use --vllm-route chat"
                ) from exc
            log.info(
                "vLLM at %s has no token route (%s): chats go by its chat route", client.base_url, exc.message
            )

    async def _probe_ec(self, client: EngineClient) -> None:
        """The server reads ``self.ec``'s folder under the uuid: vLLM's consumer creates
        ``<its folder>/<identifier>/`` for each item it is asked about, so a harmless inline probe
        whose uuid names a fresh folder must make it appear here."""
        assert self.ec is not None
        key = f"epd-ec-probe-{uuid.uuid4().hex}"
        probe = self.ec.root / key
        try:
            await client.complete(self._probe_body(key), path=CHAT)
            seen = probe.is_dir()
        finally:
            with contextlib.suppress(OSError):
                probe.rmdir()
        if not seen:
            raise ServerMismatch(
                f"vLLM at {client.base_url} does not read the encoder-cache folder {self.ec.root} "
                "(--vllm-ec-path) under the parts' uuid: start it with --ec-transfer-config "
                f"'{ec_transfer_config(self.ec.root)}' (that folder, as its host sees it) and "
                "without --mm-processor-kwargs"
            )

    # -- requests ------------------------------------------------------------------------------
    async def chat_call(
        self, messages: Sequence[ChatMessage], items: Sequence[EncodedItem], sampling: dict[str, Any]
    ) -> ChatCall:
        self._refuse_unsent_modalities(items)
        if self.token_route and self._fits_token_route(items, sampling):
            return await self._token_call(messages, items, sampling)
        self._refuse_spelled_specials(messages)
        routing = RoutingPrompt([])
        if self.render_routes:
            routing, _ = await self._render.run(partial(render_chat, self.prompt_format, messages, items))
        if self.ec is not None:
            parts = await self._ec_parts(items)
        else:
            parts = await self._inline_parts(items)
        out_messages = []
        for m in messages:
            content = [
                parts[p["index"]] if "index" in p else {"type": "text", "text": p["text"]}
                for p in m["content"]
            ]
            out_messages.append({"role": m["role"], "content": content})
        estimate = None if routing.token_ids else _prompt_estimate(messages, items)
        return ChatCall(CHAT, {"messages": out_messages, **sampling}, routing, estimate, relay=True)

    def _refuse_unsent_modalities(self, items: Sequence[EncodedItem]) -> None:
        """The ingress drops the modalities this server kind does not hand on (``PromptFormat.only``);
        an item of one that got here anyway is refused, never sent."""
        for item in items:
            if item.ref.modality not in self.modalities:
                why = f": {self.model.profile.refused_because}" if self.model.profile.refused_because else ""
                raise APIError(
                    415,
                    f"{item.name}: the {self.name} LLM server does not take {item.ref.modality} input{why}",
                    type="unsupported_media_type",
                    param=item.name,
                )

    @staticmethod
    def _fits_token_route(items: Sequence[EncodedItem], sampling: Mapping[str, Any]) -> bool:
        """Images and text, sampling the route takes (videos and structured outputs: the chat route)."""
        return all(it.ref.modality == "image" for it in items) and not CHAT_ONLY.intersection(sampling)

    async def _token_call(
        self, messages: Sequence[ChatMessage], items: Sequence[EncodedItem], sampling: dict[str, Any]
    ) -> ChatCall:
        """The chat rendered and tokenized here (request text as text), each image's checked
        embedding as an item of vLLM's token route (``vllm_tokens``)."""
        routing, refs = await self._render.run(partial(render_chat, self.prompt_format, messages, items))
        tensors = await self._resolve(items)
        encoded: dict[str, str] = {}
        for i, (item, mm) in enumerate(zip(items, tensors, strict=True)):
            self._check(item, i, mm.embedding)
            encoded[item.ref.key] = await asyncio.to_thread(image_item, mm.embedding, item.ref.grid_thw[0])
        if len(routing.media) != len(refs):
            # the pads did not pair with the images (the template's own doing): never sent unpaired
            raise bad_request("the chat's images do not line up with its rendered prompt", "messages")
        return ChatCall(GENERATE, generate_body(routing, refs, encoded, sampling), routing)

    def _refuse_spelled_specials(self, messages: Sequence[ChatMessage]) -> None:
        """The chat route hands vLLM the text, which its template and tokenizer read with special
        tokens live: a user spelling ``<|im_end|>`` would close their turn there. Where the token
        route does not serve a chat, such text is refused, never sent."""
        marks = mask_chat(messages, self.prompt_format.tokenizer.special_texts).marks
        spelled = [m for m in marks if m]
        if spelled:
            raise bad_request(
                f"the text spells the special token {spelled[0]!r}, which this chat's route to the "
                "language model (vLLM's chat completions) would read as a control token; the token "
                "route keeps it text (vLLM with --enable-scale-out, images and text only)",
                "messages",
            )

    async def _ec_parts(self, items: Sequence[EncodedItem]) -> list[dict[str, Any]]:
        """Metadata-only parts whose files are in place: those already there (header checked) are
        not read again; the others are resolved, checked as inline ones and written. An item whose
        file cannot be written goes inline."""
        ec, geometry = self.ec, self.model.geometry
        assert ec is not None
        for i, it in enumerate(items):
            try:
                check_seconds(it.ref)  # a file in place is not checked again below
            except EmbeddingMismatch as exc:
                raise self._mismatch(it, i, exc) from exc
        present = await asyncio.to_thread(lambda: [ec.has(it.ref, geometry) for it in items])
        missing = [i for i, ok in enumerate(present) if not ok]
        tensors = await self._resolve([items[i] for i in missing])
        inline: dict[int, dict[str, Any]] = {}
        for i, mm in zip(missing, tensors, strict=True):
            self._check(items[i], i, mm.embedding)
        for i, mm in zip(missing, tensors, strict=True):
            if not await asyncio.to_thread(ec.write, items[i].ref, mm.embedding):
                part = await asyncio.to_thread(embeds_part, items[i].ref, mm.embedding, geometry)
                # not under the key: vLLM prefers a file of that name, and a wrong one may be there
                inline[i] = {**part, "uuid": f"{items[i].ref.key}-inline"}
        return [inline[i] if i in inline else metadata_part(it.ref) for i, it in enumerate(items)]

    async def _resolve(self, items: Sequence[EncodedItem]) -> list[MultimodalInput]:
        """The items' tensors (node cache, else the encoder's URL). A cache entry that disagrees
        with its own header is a mismatch of ours (evicted, 502); an entry evicted since the
        ingress resolved it is a retryable 503, not the client's fault."""
        out = []
        for i, item in enumerate(items):
            try:
                (mm,) = await self.source.resolve([item.ref])
            except APIError as exc:
                if exc.status != 400 and exc.type != "embedding_evicted":
                    raise
                if exc.status == 400 and self.cache is not None and self.cache.contains(item.ref.key):
                    raise self._mismatch(item, i, EmbeddingMismatch(exc.message)) from exc
                raise APIError(
                    503,
                    f"the embedding of {item.name} left the node cache before it was sent; retry",
                    type="embedding_evicted",
                    param=item.name,
                    retry_after_s=0.0,
                ) from exc
            out.append(mm)
        return out

    async def _inline_parts(self, items: Sequence[EncodedItem]) -> list[dict[str, Any]]:
        tensors = await self._resolve(items)
        parts = []
        for i, (item, mm) in enumerate(zip(items, tensors, strict=True)):
            try:
                if mm.embedding.numel() * mm.embedding.element_size() > _OFF_LOOP_BYTES:
                    part = await asyncio.to_thread(embeds_part, item.ref, mm.embedding, self.model.geometry)
                else:
                    part = embeds_part(item.ref, mm.embedding, self.model.geometry)
            except EmbeddingMismatch as exc:
                raise self._mismatch(item, i, exc) from exc
            parts.append(part)
        return parts

    def _check(self, item: EncodedItem, index: int, tensor: torch.Tensor) -> None:
        """``check_embedding``, a misfit answered as ``_mismatch`` (evicted, never sent)."""
        try:
            check_embedding(item.ref, tensor, self.model.geometry)
        except EmbeddingMismatch as exc:
            raise self._mismatch(item, index, exc) from exc

    def _mismatch(self, item: EncodedItem, index: int, exc: EmbeddingMismatch) -> APIError:
        """A cached embedding that does not fit its own grid: dropped from the node cache (the next
        request encodes it again), and this request fails without reaching vLLM."""
        if self.cache is not None:
            self.cache.evict(item.ref.key)
        log.error("embedding %s (%r) does not fit: %s; evicted", item.ref.key[:16], item.name, exc)
        return APIError(
            502,
            f"the embedding of {item.name} does not fit its grid ({exc}); it was dropped from the "
            "cache, a retry encodes it again",
            type="embedding_mismatch",
            param=item.name,
            retry_after_s=0.0,
        )

    async def completion_call(self, body: dict[str, Any]) -> ChatCall:
        if "prompt_embeds" in body:  # tensors epd has not checked: a malformed one kills vLLM
            raise bad_request("prompt_embeds are not passed on to the language model", "prompt_embeds")
        prompt = body.get("prompt")
        tok = self.prompt_format.tokenizer
        if isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)
        ):
            # vLLM would tokenize the strings with special tokens live: they go as ids, text as text
            texts = [prompt] if isinstance(prompt, str) else prompt
            ids = await self._render.run(lambda: [tok.encode_text(t) for t in texts])
            prompt = ids[0] if isinstance(prompt, str) else ids
            body = {**body, "prompt": prompt}
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return ChatCall(COMPLETIONS, body, RoutingPrompt(prompt))
        size = sum(len(p) for p in prompt) if isinstance(prompt, list) else 1
        return ChatCall(COMPLETIONS, body, RoutingPrompt([]), max(size, 1))

    async def close(self) -> None:
        self._render.close()
        await self.source.close()  # its session for remote refs; the node cache is the ingress's

    def chat_result(self, out: dict[str, Any]) -> ChatResult:
        if "output_mode" in out:  # the token route's answer
            return vllm_tokens.result(out)
        choice = out["choices"][0]
        return ChatResult(
            text=(choice.get("message") or {}).get("content") or "",
            finish_reason=choice.get("finish_reason"),
            usage=_usage(out.get("usage")),
            prompt_token_ids=out.get("prompt_token_ids"),
            token_ids=choice.get("token_ids"),
        )

    def chat_delta(self, chunk: dict[str, Any]) -> ChatDelta:
        if "output_mode" in chunk:  # the token route's chunk
            return vllm_tokens.delta(chunk)
        text, finish = "", None
        for choice in chunk.get("choices", []):
            text += (choice.get("delta") or {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
        return ChatDelta(text, finish, _usage(chunk.get("usage")) or None)


def _prompt_estimate(messages: Sequence[ChatMessage], items: Sequence[EncodedItem]) -> int:
    """The prompt's tokens for the router's load counts (least-load or round robin over vLLM need
    no prefix keys): every media row, and ~4 characters a text token; vLLM renders the real ids."""
    chars = sum(len(p.get("text", "")) for m in messages for p in m["content"] if p.get("type") == "text")
    return sum(it.ref.num_tokens for it in items) + chars // 4 + 8 * len(messages)


def _usage(usage: Any) -> dict[str, Any]:
    """vLLM's usage without its null fields."""
    return {k: v for k, v in usage.items() if v is not None} if isinstance(usage, dict) else {}


def _zeros_b64(hidden: int) -> str:
    return tensor_b64(torch.zeros(1, hidden))
