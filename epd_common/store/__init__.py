"""The cluster cache tier's store: a ``Store`` interface (``store.py``) and its tiers.

- ``disk_store.DiskStore``: files under a directory, a byte budget, LRU (one machine).
- ``redis_store.RedisStore``: a Redis or Valkey server shared by every node.
- ``guarded.GuardedStore``: wraps either so that a store that is down or slow costs a recompute,
  never a failed request.
- ``local_redis.LocalRedis``: starts a private ``redis-server`` on loopback (``--store local``).

``open_store`` maps the CLI's ``--store`` / ``--store-dir`` onto one of them. Importing this
package does not import redis-py; ``open_store`` does, for a Redis URL only.

May import: epd_common.child_process; never: encoder, llm_core, media_io, epd.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from epd_common.store.store import (
    KEY_RE,
    MAX_KEY_LEN,
    Reason,
    Store,
    StoreError,
    StoreStats,
    check_key,
)

__all__ = [
    "KEY_RE",
    "MAX_KEY_LEN",
    "REDIS_SCHEMES",
    "Reason",
    "Store",
    "StoreError",
    "StoreStats",
    "check_key",
    "open_store",
]

REDIS_SCHEMES = ("redis", "rediss", "valkey", "valkeys")


def check_redis_url(spec: str) -> str:
    """``spec`` if it is a usable ``redis://HOST:PORT[/DB]`` URL (or rediss / valkey / valkeys),
    else ``ValueError`` saying what is wrong."""
    try:
        parts = urlsplit(spec)
        port = parts.port  # parses, and raises on a non-numeric or out-of-range port
    except ValueError as e:
        raise ValueError(f"--store {spec!r} is not a valid URL: {e}") from e
    if parts.scheme not in REDIS_SCHEMES:
        raise ValueError(
            f"--store {spec!r}: unknown scheme {parts.scheme!r}; use redis://HOST:PORT "
            f"({', '.join(s + '://' for s in REDIS_SCHEMES)}), or 'local' to start a redis-server here"
        )
    if not parts.hostname:
        raise ValueError(f"--store {spec!r} names no host; e.g. redis://127.0.0.1:6379/0")
    if port is None:
        raise ValueError(f"--store {spec!r} names no port; e.g. redis://{parts.hostname}:6379/0")
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ValueError(f"--store {spec!r}: the path must be a database number, got {db!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"--store {spec!r}: query strings and fragments are not supported")
    return spec


def open_store(
    spec: str | None, directory: str | None, max_bytes: int, *, timeout_s: float = 0.25
) -> Store | None:
    """The store the CLI asked for, or None for no store.

    ``spec``: a Redis / Valkey URL -> ``RedisStore`` (``timeout_s`` per socket operation);
    ``directory`` alone -> ``DiskStore`` with a budget of ``max_bytes`` (unused for Redis, whose
    server's maxmemory bounds it). Both given, or ``spec`` "local" (the serve command starts a
    ``LocalRedis`` and passes its URL here), is a ``ValueError`` with the fix in its message.
    The store is not contacted: a server that is down shows up at the first call."""
    if spec is not None and directory is not None:
        raise ValueError(f"--store {spec!r} and --store-dir {directory!r} exclude each other: pick one tier")
    if spec == "local":
        raise ValueError(
            "--store local is resolved by the serve command (it starts a redis-server with "
            "LocalRedis and passes its URL); open_store takes the URL"
        )
    if spec is not None:
        from epd_common.store.redis_store import RedisStore

        return RedisStore(check_redis_url(spec), timeout_s=timeout_s)
    if directory is not None:
        if max_bytes <= 0:
            raise ValueError(f"--store-dir {directory!r} needs a positive byte budget, got {max_bytes}")
        from epd_common.store.disk_store import DiskStore

        return DiskStore(directory, max_bytes)
    return None
