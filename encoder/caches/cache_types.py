"""Results and errors of the node embedding cache, and the names it accepts (keys, roots).

Kept apart from ``embed_cache.py`` so that readers (the inspector CLI, the vLLM transport) can name
these types without the cache's machinery; ``encoder.caches.embed_cache`` re-exports all of them.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from encoder.caches.cache_format import MAX_KEY
from encoder.caches.cache_index import KEY_BYTES
from epd_common.messages.embedding_reader import InvalidMediaKey
from epd_common.messages.embedding_ref import EmbeddingRef

if TYPE_CHECKING:
    import torch

_KEY_RE = re.compile(r"[A-Za-z0-9_-]+")


class CacheError(Exception):
    """A request the cache cannot serve; the message names the offending value."""


class InvalidKey(CacheError, InvalidMediaKey):
    """A key that is not a safe file name (letters, digits, '_' and '-', at most 88 chars); a
    reader of the cache catches it as the shared ``InvalidMediaKey``."""


class EntryTooLarge(CacheError):
    """One entry larger than the whole byte budget."""


class CacheFull(CacheError):
    """A put that does not fit because every entry it could evict is leased (``cache_lease.py``):
    the space frees up when the requests holding those leases end, so the caller may retry."""

    def __init__(self, message: str, needed_bytes: int, capacity_bytes: int, leased_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.capacity_bytes = capacity_bytes
        self.leased_bytes = leased_bytes

    def __reduce__(self) -> tuple[type, tuple[str, int, int, int]]:  # picklable across processes
        return type(self), (str(self), self.needed_bytes, self.capacity_bytes, self.leased_bytes)


class NotCached(CacheError):
    """A lease asked for a key the cache does not hold (never written, or evicted)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"cannot lease {key}: it is not in the cache")
        self.key = key

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return type(self), (self.key,)


class CacheNotFound(CacheError):
    """A read-only open of a cache directory that does not exist."""


class EntryMeta(NamedTuple):
    """What the cache knows about one entry (``last_access_ns``/``hits`` from the index)."""

    key: str
    dtype: str
    shape: tuple[int, int]
    grid_thw: tuple[tuple[int, int, int], ...]
    modality: str
    bytes: int
    created_ns: int
    last_access_ns: int
    hits: int
    writer: str


class CachedEmbedding(NamedTuple):
    tensor: torch.Tensor  # [tokens, hidden], zero-copy view of the entry's mapping
    ref: EmbeddingRef
    meta: EntryMeta


class CacheStats(NamedTuple):
    root: str
    capacity_bytes: int
    used_bytes: int
    entries: int
    hits: int
    misses: int
    inserts: int
    evictions: int
    evicted_bytes: int
    removals: int
    # this node's use of the shared store below it (``embedding_tier.py``)
    store_hits: int = 0
    store_misses: int = 0
    store_corrupt: int = 0
    store_puts: int = 0

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


class VerifyFailure(NamedTuple):
    key: str
    reason: str


class VerifyReport(NamedTuple):
    """Result of checking every entry's header and payload checksum."""

    checked: int
    failures: list[VerifyFailure]
    orphan_tmp: int  # tmp files with no live writer (sweep removes them)
    unindexed: int  # entry files without an index record
    missing: int  # index records without an entry file

    @property
    def ok(self) -> bool:
        return not self.failures


def default_root(namespace: str) -> Path:
    """/dev/shm/epd-<namespace> (tmpfs), or the temp dir where there is no /dev/shm."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    return base / f"epd-{namespace}"


def check_key(key: str) -> str:
    if not (isinstance(key, str) and len(key) <= min(MAX_KEY, KEY_BYTES) and _KEY_RE.fullmatch(key)):
        raise InvalidKey(f"cache key must be 1-{KEY_BYTES} chars of [A-Za-z0-9_-], got {key!r}")
    return key
