"""Where the engine process gets multimodal embeddings: the node cache, else the encoder's URL.

An ``EmbeddingRef`` names the tensor by MediaKey. On the encoder's node the bytes are in the
shared-memory embedding cache and are read zero-copy (through ``EmbeddingReader``: the engine
does not import the encoder; whoever wires the process passes the opener); from another node the
engine fetches ``ref.url`` (a safetensors body with tensor ``embedding``). Either way the tensor
must have the shape the ref announces, or the request fails with a 400 naming the item.

An item that is in neither place (not in this node's cache, and its url answers 404 or there is
none) was evicted after the ingress resolved it: not the client's fault, a retryable 503 of type
``embedding_evicted`` naming the item (the ingress leases a request's entries, so this is rare).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import aiohttp
import torch
from safetensors.torch import load as load_safetensors

from epd_common.errors import APIError, bad_request
from epd_common.messages.embedding_reader import EmbeddingReader, InvalidMediaKey, ReaderOpener
from epd_common.messages.embedding_ref import EmbeddingRef
from llm_core.request import MultimodalInput

log = logging.getLogger(__name__)


class EmbeddingSource:
    """Resolves EmbeddingRefs to tensors. ``cache``: this node's embedding cache, or None."""

    def __init__(
        self,
        cache: EmbeddingReader | None,
        hidden_size: int,
        timeout_s: float = 30.0,
        owns_cache: bool = False,
    ) -> None:
        self.cache = cache
        self.owns_cache = owns_cache  # close() closes the cache only when open() made it
        self.hidden_size = hidden_size
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5.0)
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def open(
        cls, opener: ReaderOpener | None, namespace: str, hidden_size: int, timeout_s: float = 30.0
    ) -> EmbeddingSource:
        """Attach to the node cache of ``namespace`` through ``opener`` (None, or an opener that
        finds no usable cache: ref URLs only)."""
        cache = opener(namespace) if opener is not None else None
        if opener is None:
            log.info("no node embedding cache is wired into this process; only ref URLs will be fetched")
        return cls(cache, hidden_size, timeout_s, owns_cache=cache is not None)

    async def resolve(self, refs: Sequence[EmbeddingRef]) -> list[MultimodalInput]:
        """One MultimodalInput per ref, in order; APIError naming ``multimodal[i]`` on failure (400,
        or 503 ``embedding_evicted`` for an entry gone from the node cache and from its url)."""
        out = []
        for i, ref in enumerate(refs):
            param = f"multimodal[{i}]"
            tensor = self._local(ref, param)
            if tensor is None:
                tensor = await self._fetch(ref, param)
            self._check(ref, tensor, param)
            out.append(MultimodalInput(ref, tensor))
        return out

    def _local(self, ref: EmbeddingRef, param: str) -> torch.Tensor | None:
        if self.cache is None:
            return None
        try:
            hit = self.cache.get(ref.key)
        except InvalidMediaKey as e:
            raise bad_request(str(e), param) from e
        return None if hit is None else hit.tensor

    async def _fetch(self, ref: EmbeddingRef, param: str) -> torch.Tensor:
        if not ref.url:
            raise evicted(ref, param, "the ref has no url")
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        try:
            async with self._session.get(ref.url) as resp:
                if resp.status == 404:
                    raise evicted(ref, param, f"{ref.url} answered 404")
                if resp.status != 200:
                    raise bad_request(f"fetching {ref.url} answered HTTP {resp.status}", param)
                body = await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise APIError(
                502, f"fetching {ref.url} failed: {type(e).__name__}: {e}", type="upstream_error", param=param
            ) from e
        try:
            tensors = load_safetensors(body)
        except Exception as e:  # safetensors raises its own error types for corrupt bodies
            raise bad_request(f"{ref.url} is not a safetensors body: {e}", param) from e
        if "embedding" not in tensors:
            raise bad_request(f"{ref.url} has no tensor 'embedding' (has {sorted(tensors)})", param)
        return tensors["embedding"]

    def _check(self, ref: EmbeddingRef, tensor: torch.Tensor, param: str) -> None:
        if tensor.dim() != 2 or tuple(tensor.shape) != tuple(ref.shape):
            raise bad_request(f"embedding shape {tuple(tensor.shape)} != ref shape {tuple(ref.shape)}", param)
        if tensor.shape[1] != self.hidden_size:
            raise bad_request(
                f"embedding hidden size {tensor.shape[1]} != the LLM's hidden size {self.hidden_size}", param
            )

    async def close(self) -> None:
        if self.cache is not None and self.owns_cache:
            self.cache.close()
        self.cache = None
        if self._session is not None:
            await self._session.close()
            self._session = None


def evicted(ref: EmbeddingRef, param: str, where: str) -> APIError:
    """The entry left the node cache between the ingress resolving it and this read: retry."""
    return APIError(
        503,
        f"embedding {ref.key[:16]}... is no longer in this node's cache and {where}: it was evicted"
        " after the ingress resolved it; retry the request",
        type="embedding_evicted",
        param=param,
        retry_after_s=0.0,
    )
