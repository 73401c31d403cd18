"""Where the shared cache tier lives (``epd serve --store URL`` / ``--store-dir DIR``).

One config for every role of a node: the ingress and the encoder workers read and write
embeddings there (``encoder/caches/embedding_tier.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from epd_common.store.guarded import GuardedStore


@dataclass(frozen=True)
class StoreConfig:
    # redis://HOST:PORT[/DB] (Valkey speaks the same protocol: valkey:// is accepted); "local":
    # ``epd serve`` starts a redis-server on loopback and stops it on exit; None: no store
    url: str | None = None
    dir: str | None = None  # a local-disk tier instead of Redis (files, LRU within max_bytes)
    max_bytes: int = 4 << 30  # the disk tier's budget; a local redis-server's maxmemory
    ttl_s: float = 7 * 24 * 3600.0  # how long a value stays in the store unless evicted first
    timeout_s: float = 0.25  # one store call; slower counts as down (recompute, retry later)
    retry_after_s: float = 5.0  # how long a store that failed is left alone
    claim_ttl_s: float = 30.0  # how long another node waits on an encode this node claimed

    def __post_init__(self) -> None:
        if self.url and self.dir:
            raise ValueError("give a store url or a store dir, not both")
        for name in ("max_bytes", "ttl_s", "timeout_s", "retry_after_s", "claim_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"StoreConfig.{name} must be > 0, got {getattr(self, name)}")

    @property
    def enabled(self) -> bool:
        return bool(self.url or self.dir)


def build_store(config: StoreConfig) -> GuardedStore | None:
    """The configured store behind its guard (never raises once built), or None without one.
    A bad url or directory fails here, at start-up, with a message naming it."""
    if not config.enabled:
        return None
    from epd_common.store import open_store
    from epd_common.store.guarded import GuardedStore

    store = open_store(config.url, config.dir, config.max_bytes, timeout_s=config.timeout_s)
    assert store is not None
    return GuardedStore(store, retry_after_s=config.retry_after_s)
