"""The store interface: a shared key -> bytes tier under the node caches (embeddings now, KV pages later).

::

    caller (a worker thread)                 Store                        backing
    hits = s.exists(keys)          ->   validate keys         ->   files in a directory (DiskStore)
    vals = s.get(keys)             ->   one batch, one trip   ->   Redis / Valkey (RedisStore)
    s.put([(key, blob)], ttl_s)
    if s.claim(key, ttl_s): compute; s.put(...); s.unclaim(key)

A store knows nothing of what it holds: a value is opaque bytes (for the embedding tier, a node
cache entry in ``encoder.caches.cache_format``'s layout, whose header and checksums the *caller*
checks; a value that fails them is recomputed and put again). What every store guarantees:

- ``get`` returns, per key, the bytes last put under it, or None (absent, expired, evicted); never
  another key's bytes. A store may lose any entry at any time (eviction, TTL, a restart): callers
  treat a miss as "compute".
- Calls are synchronous and may block on I/O (callers run them in a thread); a remote store gives
  up after its timeout rather than waiting on a dead or slow server.
- Every failure is a ``StoreError`` whose ``reason`` says which kind, so callers can count them and
  ``GuardedStore`` can tell a store that is down from a request that was wrong.
- ``claim`` is an atomic create-if-absent of a short-lived marker beside the key (not the key
  itself: ``exists`` does not see it). True means the caller owns the work; the marker lapses
  after ``ttl_s`` so a claimer that died does not block the key for long. ``unclaim`` removes the
  marker only if this store instance still owns it.

Keys are ``<namespace>:<rest>``: the caller picks the namespace (``epd:`` for this service, one
per kind of value, e.g. ``epd:emb/...``, ``epd:kv/...``) so that several tiers can share a server;
the store only checks the rule (``check_key``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Literal, NamedTuple, Protocol, get_args

Reason = Literal["unavailable", "timeout", "too_large", "invalid"]
"""Why a store call failed:

- ``unavailable``: the store cannot be reached or refused the call (connection refused or reset,
  disk error, the store was closed)
- ``timeout``: the store did not answer within its timeout (a slow or stopped server)
- ``too_large``: a value larger than the store accepts (``max_value_bytes``, the disk budget, or
  the server's memory)
- ``invalid``: the call itself was wrong (a malformed key, a value that is not bytes, a bad TTL);
  a caller bug, not a sign that the store is unwell
"""

Value = bytes | bytearray | memoryview  # what put accepts; get always returns bytes

MAX_KEY_LEN = 512
KEY_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,31}:[A-Za-z0-9_.:/@=+-]+")
"""``<namespace>:<rest>``; ``#`` and whitespace are never in a key (the claim marker is
``<key>#claim``, so it cannot collide with a value key)."""
CLAIM_SUFFIX = "#claim"


class StoreError(Exception):
    """A store call that did not complete; ``reason`` is one of ``Reason``, the message says why."""

    def __init__(self, reason: Reason, message: str) -> None:
        assert reason in get_args(Reason), reason
        super().__init__(f"{reason}: {message}")
        self.reason: Reason = reason


class StoreStats(NamedTuple):
    """What a store knows cheaply. ``entries`` / ``bytes`` are -1 where it cannot tell; the counters
    are this instance's (this process's), not the backing store's."""

    kind: str  # "disk", "redis", ...
    location: str  # the directory, or the URL without its password
    entries: int
    bytes: int
    hits: int
    misses: int
    errors: int
    puts: int


class Store(Protocol):
    """A shared key -> bytes store; see the module docstring for what every implementation holds.

    Thread-safe: one instance per process, called from any number of worker threads.
    """

    name: str

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether a ``get`` now would return bytes (a hint: it may be evicted next)."""
        ...

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Per key, its bytes or None; one round trip for the whole batch."""
        ...

    def put(self, items: Sequence[tuple[str, Value]], ttl_s: float | None = None) -> None:
        """Store every (key, value), replacing what was there; ``ttl_s`` None keeps them until
        evicted. The whole batch is validated before anything is written."""
        ...

    def delete(self, keys: Sequence[str]) -> None:
        """Remove the keys; absent ones are ignored."""
        ...

    def claim(self, key: str, ttl_s: float) -> bool:
        """Atomically create the claim marker of ``key`` if absent; True = the caller owns the work."""
        ...

    def unclaim(self, key: str) -> None:
        """Remove ``key``'s claim marker if this instance owns it; otherwise do nothing."""
        ...

    def stats(self) -> StoreStats: ...

    def close(self) -> None:
        """Release this instance's resources; later calls raise ``StoreError("unavailable")``."""
        ...


def check_key(key: object) -> str:
    """``key`` if it follows the key rule, else ``StoreError("invalid")`` naming it."""
    if not isinstance(key, str) or len(key) > MAX_KEY_LEN or not KEY_RE.fullmatch(key):
        raise StoreError(
            "invalid",
            f"a store key is <namespace>:<rest> matching {KEY_RE.pattern}, "
            f"at most {MAX_KEY_LEN} chars; got {key!r}",
        )
    return key


def check_keys(keys: Sequence[str]) -> list[str]:
    """Every key checked; a bare string (which would iterate as characters) is refused."""
    if isinstance(keys, str | bytes):
        raise StoreError("invalid", f"keys must be a sequence of keys, got the string {keys!r}")
    return [check_key(k) for k in keys]


def check_items(
    items: Sequence[tuple[str, Value]], max_value_bytes: int
) -> list[tuple[str, bytes | memoryview]]:
    """Every (key, value) checked: a valid key, a bytes-like value of at most ``max_value_bytes``
    (as bytes or a flat byte view: ``len`` is its size in bytes)."""
    checked: list[tuple[str, bytes | memoryview]] = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise StoreError("invalid", f"put takes (key, value) pairs, got {type(item).__name__}")
        key, value = check_key(item[0]), item[1]
        if not isinstance(value, bytes | bytearray | memoryview):
            raise StoreError("invalid", f"the value of {key!r} must be bytes, got {type(value).__name__}")
        if not isinstance(value, bytes):  # a flat byte view; a non-contiguous one is refused
            try:
                value = memoryview(value).cast("B")
            except TypeError as e:
                raise StoreError("invalid", f"the value of {key!r} is not a contiguous buffer: {e}") from e
        nbytes = len(value)
        if nbytes > max_value_bytes:
            raise StoreError("too_large", f"the value of {key!r} is {nbytes} bytes, over {max_value_bytes}")
        checked.append((key, value))
    return checked


def check_ttl(ttl_s: float | None, *, required: bool = False) -> float | None:
    """``ttl_s`` if None (and allowed) or a positive finite number of seconds."""
    if ttl_s is None and not required:
        return None
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not (0 < ttl_s < math.inf):
        raise StoreError("invalid", f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
    return float(ttl_s)
