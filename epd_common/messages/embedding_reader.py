"""The node embedding cache as a process that only reads it sees it.

The encoder owns the cache and its file format (``encoder.caches.embed_cache.EmbedCache`` is the
implementation); a reader (the LLM engine, the ingress's vLLM backend) names only this interface,
so it needs no import of the encoder. The process that wires a role (``epd llm``) passes a
``ReaderOpener`` that opens the encoder's cache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from epd_common.messages.embedding_ref import MediaKey

if TYPE_CHECKING:
    import torch


class InvalidMediaKey(ValueError):
    """A key the cache cannot hold (not a safe file name): the request that named it is a 400."""


class CachedTensor(Protocol):
    """One cache hit."""

    @property
    def tensor(self) -> torch.Tensor:
        """[num_tokens, hidden], a zero-copy view of the entry (valid after its eviction)."""
        ...


class EmbeddingReader(Protocol):
    def get(self, key: MediaKey, touch: bool = True) -> CachedTensor | None:
        """The embedding named ``key``, or None when this node's cache does not hold it;
        ``InvalidMediaKey`` for a key no entry can have. ``touch`` counts the read (LRU, hits)."""
        ...

    def close(self) -> None: ...


# Opens this node's cache of a namespace for reading; None when there is no usable one here
# (the reader then fetches each ref's url).
ReaderOpener = Callable[[str], EmbeddingReader | None]
