"""The Redis / Valkey tier: the ``Store`` interface over redis-py, one connection pool per process.

::

    exists(keys)        pipeline: EXISTS k1, EXISTS k2, ...     one round trip
    get(keys)           MGET k1 k2 ...                          one round trip
    put(items, ttl_s)   pipeline: SET k v [PX ms], ...          one round trip
    delete(keys)        DEL k1 k2 ...
    claim(key, ttl_s)   SET <key>#claim <token> NX PX ms        True = this instance owns the work
    unclaim(key)        EVAL: DEL <key>#claim if its value is still <token>

Valkey speaks the same protocol: a ``valkey://`` URL (or a ``redis://`` one pointing at a Valkey
server) works unchanged. The server does eviction (``maxmemory`` + ``allkeys-lru``: ``LocalRedis``
starts it so); this class never scans or evicts.

Failing fast: every socket operation has ``timeout_s`` (connect and read), and redis-py's own retry
is switched off (``Retry(NoBackoff(), 0)``): a ``redis.Redis`` built the default way retries a
failed command up to 10 times with exponential backoff, which would turn a dead server into
seconds of waiting per call. So a refused connection raises ``StoreError("unavailable")`` in about
a millisecond, a stopped server ``StoreError("timeout")`` after ``timeout_s``; ``GuardedStore`` then
stops calling for a while. A pooled connection the server closed (it restarted) is noticed and
reopened by redis-py when it is checked out, so a restarted server is usable on the next call.
``timeout_s`` bounds each socket read, not a whole call: a server that trickles a large reply may
take longer (a value is at most ``max_value_bytes``).

Pools: one ``redis.BlockingConnectionPool`` per (url, timeout, size) in this process, shared by
every instance (several tiers, several threads); a forked child drops the parent's pools (their
sockets belong to the parent) and makes its own. A thread that finds all ``pool_size`` connections
busy waits up to ``timeout_s`` for one.
"""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.exceptions as rexc
from redis.backoff import NoBackoff
from redis.retry import Retry

from epd_common.store.store import (
    CLAIM_SUFFIX,
    Reason,
    StoreError,
    StoreStats,
    Value,
    check_items,
    check_key,
    check_keys,
    check_ttl,
)

DEFAULT_MAX_VALUE_BYTES = 64 << 20
DEFAULT_POOL_SIZE = 16

_UNCLAIM_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""

_PoolKey = tuple[str, float, int]
_pools: dict[_PoolKey, redis.BlockingConnectionPool] = {}
_pools_pid = os.getpid()
_pools_lock = threading.Lock()


def _reset_pools_in_child() -> None:
    """After a fork: forget the parent's pools (never close them: the sockets are the parent's)."""
    global _pools_lock, _pools_pid
    _pools_lock = threading.Lock()  # it may have been held by a thread that does not exist here
    _pools.clear()
    _pools_pid = os.getpid()


os.register_at_fork(after_in_child=_reset_pools_in_child)


def redis_url(url: str) -> str:
    """``url`` with ``valkey://`` / ``valkeys://`` spelled as redis-py expects."""
    for alias, scheme in (("valkey://", "redis://"), ("valkeys://", "rediss://")):
        if url.startswith(alias):
            return scheme + url[len(alias) :]
    return url


def public_url(url: str) -> str:
    """``url`` without its password, for logs and stats."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


def shared_pool(url: str, timeout_s: float, pool_size: int) -> redis.BlockingConnectionPool:
    """This process's pool for (url, timeout_s, pool_size), made on first use."""
    if _pools_pid != os.getpid():  # forked without the at-fork hook (not via os.fork)
        _reset_pools_in_child()
    key = (url, timeout_s, pool_size)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = redis.BlockingConnectionPool.from_url(
                redis_url(url),
                max_connections=pool_size,
                timeout=timeout_s,  # waiting for a free connection
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
            )
            _pools[key] = pool
        return pool


def close_pools() -> None:
    """Disconnect every pool of this process (at exit, or between tests)."""
    with _pools_lock:
        for pool in _pools.values():
            pool.disconnect()
        _pools.clear()


def _reason_of(exc: rexc.RedisError) -> Reason:
    if isinstance(exc, rexc.TimeoutError):
        return "timeout"
    if isinstance(exc, rexc.OutOfMemoryError):
        return "too_large"  # maxmemory reached and nothing evictable (or noeviction)
    if isinstance(exc, rexc.DataError):
        return "invalid"
    return "unavailable"  # refused / reset connections, a full pool, server errors


T = TypeVar("T")


class RedisStore:
    """``Store`` over a Redis or Valkey server at ``url`` (``redis://``, ``rediss://``, ``valkey://``;
    ``redis://[:password@]host:port/db``). Constructing one does not connect: the first call does.

    ``timeout_s``: connect / read timeout and the wait for a free pooled connection.
    ``max_value_bytes``: larger values are refused with ``too_large`` before anything is sent
    (Redis's own limit is 512 MB per value).
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 0.25,
        pool_size: int = DEFAULT_POOL_SIZE,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if pool_size < 1:
            raise ValueError(f"pool_size must be at least 1, got {pool_size}")
        if max_value_bytes < 1:
            raise ValueError(f"max_value_bytes must be at least 1, got {max_value_bytes}")
        self.url = url
        self.timeout_s = timeout_s
        self.pool_size = pool_size
        self.max_value_bytes = max_value_bytes
        self._token = secrets.token_hex(16)  # this instance's claim marker value
        self._lock = threading.Lock()
        self._hits = self._misses = self._errors = self._puts = 0
        self._closed = False
        self._client_pid = -1
        self._client: redis.Redis | None = None
        self._unclaim: Any = None

    def _redis(self) -> redis.Redis:
        """The client on this process's shared pool (rebuilt after a fork)."""
        if self._closed:
            raise StoreError("unavailable", f"the store {public_url(self.url)} was closed")
        pid = os.getpid()
        if self._client is None or self._client_pid != pid:
            pool = shared_pool(self.url, self.timeout_s, self.pool_size)
            client = redis.Redis(connection_pool=pool)
            self._unclaim = client.register_script(_UNCLAIM_LUA)
            self._client, self._client_pid = client, pid
        return self._client

    @contextmanager
    def _errors_as_store_errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except (rexc.RedisError, OSError) as e:
            with self._lock:
                self._errors += 1
            reason = _reason_of(e) if isinstance(e, rexc.RedisError) else "unavailable"
            raise StoreError(reason, f"{what} on {public_url(self.url)}: {type(e).__name__}: {e}") from e

    def _call(self, what: str, fn: Callable[[redis.Redis], T]) -> T:
        with self._errors_as_store_errors(what):
            return fn(self._redis())

    # ------------------------------------------------------------------ Store
    def exists(self, keys: Sequence[str]) -> list[bool]:
        keys = check_keys(keys)
        if not keys:
            return []

        def run(r: redis.Redis) -> list[Any]:
            pipe = r.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return pipe.execute()

        return [bool(n) for n in self._call("EXISTS", run)]

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        keys = check_keys(keys)
        if not keys:
            return []
        values = cast("list[bytes | None]", self._call("MGET", lambda r: r.mget(keys)))
        hits = sum(v is not None for v in values)
        with self._lock:
            self._hits += hits
            self._misses += len(values) - hits
        return values

    def put(self, items: Sequence[tuple[str, Value]], ttl_s: float | None = None) -> None:
        ttl = check_ttl(ttl_s)
        checked = check_items(items, self.max_value_bytes)
        if not checked:
            return
        px = None if ttl is None else max(1, round(ttl * 1000))

        def run(r: redis.Redis) -> list[Any]:
            pipe = r.pipeline(transaction=False)
            for key, value in checked:
                pipe.set(key, value, px=px)
            return pipe.execute()

        self._call("SET", run)
        with self._lock:
            self._puts += len(checked)

    def delete(self, keys: Sequence[str]) -> None:
        keys = check_keys(keys)
        if keys:
            self._call("DEL", lambda r: r.delete(*keys))

    def claim(self, key: str, ttl_s: float) -> bool:
        marker = check_key(key) + CLAIM_SUFFIX
        ttl = check_ttl(ttl_s, required=True)
        assert ttl is not None
        px = max(1, round(ttl * 1000))
        return bool(self._call("SET NX", lambda r: r.set(marker, self._token, nx=True, px=px)))

    def unclaim(self, key: str) -> None:
        marker = check_key(key) + CLAIM_SUFFIX

        def run(r: redis.Redis) -> Any:
            return self._unclaim(keys=[marker], args=[self._token], client=r)

        self._call("unclaim", run)

    def stats(self) -> StoreStats:
        """``entries`` is the server's DBSIZE: every key of the database, other namespaces' and
        claim markers included (counting one namespace would take a SCAN of the whole keyspace);
        ``bytes`` is the server's ``used_memory``."""

        def run(r: redis.Redis) -> list[Any]:
            pipe = r.pipeline(transaction=False)
            pipe.dbsize()
            pipe.info("memory")
            return pipe.execute()

        dbsize, memory = self._call("stats", run)
        with self._lock:
            return StoreStats(
                kind=self.name,
                location=public_url(self.url),
                entries=int(dbsize),
                bytes=int(memory.get("used_memory", -1)),
                hits=self._hits,
                misses=self._misses,
                errors=self._errors,
                puts=self._puts,
            )

    def close(self) -> None:
        """Later calls raise; the shared pool stays for the process's other instances
        (``close_pools`` disconnects it)."""
        self._closed = True
        self._client = None

    def __repr__(self) -> str:
        return f"RedisStore({public_url(self.url)!r}, timeout_s={self.timeout_s})"
