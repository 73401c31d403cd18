"""One request's hold on its media in the node cache, from resolving them to the engine's answer.

::

    held = pipeline.lease_for(deadline_s)       # TTL: the request's deadline + LEASE_MARGIN_S
    items = await pipeline.resolve_all(sources, deadline_s, held)
        each item, once its ref is known ──▶ held.hold(): leased (no process evicts it now)
        the request's entries together > the node cache's capacity ──▶ 413, before any engine work
        a worker's put found only leased entries to evict ──▶ 413 if this request's own entries
            are what cannot fit, else 503 cache_full (other requests hold the room; retry)
        an entry evicted before its lease was taken ──▶ 503 embedding_evicted (retry)
    ... the engine reads the embeddings ...
    held.release()                              # in a finally: the answer went, or failed

Without a lease, a request whose media nearly fill the cache evicts its own first items while its
last ones are written, and the engine finds them gone. A lease is an ``EmbedCache.lease`` per item
(``encoder.caches.cache_lease``): it protects the entries from every process of the node, and a
crashed ingress's leases end by themselves at their TTL.
"""

from __future__ import annotations

from encoder.caches.embed_cache import CacheLease, EmbedCache, NotCached, entry_size
from epd_common.errors import CACHE_FULL, APIError
from epd_common.messages.embedding_ref import EmbeddingRef

# How long a lease outlives the request's deadline: the engine reads the embeddings when it takes
# the request (before the deadline), so this only covers the answer's way back. A lease must not
# outlive a crashed ingress for long: it would keep those bytes from every other request.
LEASE_MARGIN_S = 30.0
CAPACITY_FLAG = "--cache-capacity-bytes"


class MediaLease:
    """The entries one request is about to hand to the engine, leased in the node cache."""

    def __init__(self, cache: EmbedCache, ttl_s: float) -> None:
        self.cache = cache
        self.ttl_s = ttl_s
        self._leases: list[CacheLease] = []
        self._bytes: dict[str, int] = {}  # every distinct entry of the request resolved so far
        self._lost: list[str] = []  # items whose entry was evicted before it could be leased
        self._lost_keys: set[str] = set()
        self._released = False

    @property
    def bytes(self) -> int:
        """What the request's entries resolved so far take in the cache, each once."""
        return sum(self._bytes.values())

    def hold(self, name: str, ref: EmbeddingRef) -> bool:
        """Lease ``ref``'s entry for the request: False when the cache no longer has it (the
        caller encodes it again, or calls ``lost``). 413 once the request's entries together
        exceed what the cache can hold."""
        if not ref.key or self._released:  # a silent track has no entry; a finished request needs none
            return True
        if ref.key in self._bytes and ref.key not in self._lost_keys:
            return True  # the same medium twice: one entry, leased once
        try:
            lease = self.cache.lease([ref.key], self.ttl_s)
        except NotCached:
            return False
        self._leases.append(lease)
        self._bytes[ref.key] = lease.bytes
        self._check_fits(name)
        return True

    def lost(self, name: str, ref: EmbeddingRef) -> None:
        """``ref``'s entry was evicted before it could be leased. Counted all the same (a request
        that cannot fit gets its 413), then ``check`` answers a retryable 503."""
        self._bytes.setdefault(ref.key, entry_size(ref))
        self._lost.append(name)
        self._lost_keys.add(ref.key)
        self._check_fits(name)

    def no_room(self, name: str, needed_bytes: int | None, cause: Exception) -> APIError:
        """An item's put found every evictable entry leased. When this request's own entries and
        that one exceed the cache, no retry can help: 413; otherwise other requests hold the room
        until they end: a retryable 503."""
        if needed_bytes is not None:
            self._check_fits(name, needed_bytes)
        return cache_full(name, cause)

    def check(self) -> None:
        """Once every item is resolved: 503 ``embedding_evicted`` when one was lost."""
        if self._lost:
            raise APIError(
                503,
                f"the embedding of {self._lost[0]} left the node cache before this request could "
                "hold it (the cache is busy); retry",
                type="embedding_evicted",
                param=self._lost[0],
                retry_after_s=0.0,
            )

    def release(self) -> None:
        """Let the entries go (idempotent): the engine has answered, or the request failed."""
        self._released = True
        for lease in self._leases:
            lease.release()

    def _check_fits(self, name: str, extra: int = 0) -> None:
        need = self.bytes + extra
        capacity = self.cache.capacity_bytes
        if need > capacity:
            raise APIError(
                413,
                f"the request's media need at least {need} bytes of embeddings and the node cache"
                f" holds {capacity} bytes ({name} and the items before it did not fit): send fewer or"
                f" smaller media, or start the service with a larger {CAPACITY_FLAG}",
                type="media_too_large",
                param=name,
            )


def cache_full(name: str, cause: Exception) -> APIError:
    """A retryable 503: the node cache had no room for ``name`` that leases did not hold."""
    return APIError(
        503,
        f"no room in the node cache for {name} now (other requests' media are held there): {cause}",
        type=CACHE_FULL,
        param=name,
        retry_after_s=1.0,
    )
