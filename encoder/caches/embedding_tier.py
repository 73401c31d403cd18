"""The node cache's second tier: embeddings in a store shared by every node (Redis / Valkey, or a
local disk), as the node cache's own entry bytes.

    node-cache miss ──lookup──▶ store.get("epd:emb:<MediaKey>") ──check (magic, header crc,
        payload crc, key)──▶ node cache ──▶ ref        (a corrupt value is deleted and counted:
                                                        the caller encodes and the new value replaces it)
    new embedding ──publish (in the background, after the reply)──▶ store.put(..., ttl)

Single-flight across nodes: before encoding, a worker ``claim``s ``epd:emb-claim:<MediaKey>``
(create-if-absent with a short TTL); a worker that loses waits for the winner's value for at most
the claim's TTL (``wait_for``) and encodes itself only if it never comes (the winner died).

The store is a ``GuardedStore``: a store that is down or slow answers misses at once (with a
warning and a metric); nothing here raises because of it. The MediaKey already names the
checkpoint and the preprocessing, so nodes of different models never share an entry.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from typing import NamedTuple

import torch

from encoder.caches.cache_format import CorruptEntry, parse_header, payload_crc
from encoder.caches.embed_cache import EmbedCache, ref_of
from epd_common.messages.embedding_ref import EmbeddingRef
from epd_common.store.store import Store

KEY_PREFIX = "epd:emb:"
CLAIM_PREFIX = "epd:emb-claim:"


class Decoded(NamedTuple):
    ref: EmbeddingRef
    tensor: torch.Tensor  # [tokens, hidden], a view of the value's bytes


def decode_entry(key: str, data: bytes) -> Decoded:
    """The embedding in ``data`` (node-cache entry bytes); ``CorruptEntry`` unless every check
    passes: header (magic, version, crc, lengths), payload crc, and the key it names."""
    hdr = parse_header(data, len(data))
    if hdr.key != key:
        raise CorruptEntry(f"the value names key {hdr.key!r}, not {key!r}")
    payload = memoryview(data)[hdr.header_len :]
    if payload_crc(payload) != hdr.payload_crc:
        raise CorruptEntry("payload crc mismatch")
    rows, cols = hdr.shape
    tensor = torch.frombuffer(bytearray(payload), dtype=getattr(torch, hdr.dtype)).view(rows, cols)
    return Decoded(ref_of(hdr), tensor)


class EmbeddingTier:
    """Synchronous (run it in an executor): every call is a store round trip."""

    def __init__(
        self, store: Store, cache: EmbedCache, *, ttl_s: float | None = None, claim_ttl_s: float = 30.0
    ) -> None:
        self.store = store
        self.cache = cache
        self.ttl_s = ttl_s
        self.claim_ttl_s = claim_ttl_s

    def lookup(self, key: str) -> EmbeddingRef | None:
        """Bring ``key`` from the store into the node cache; its ref, or None (absent, corrupt,
        store down)."""
        (data,) = self.store.get([KEY_PREFIX + key])
        if data is None:
            self.cache.count("store_misses")
            return None
        try:
            got = decode_entry(key, data)
        except CorruptEntry:
            self.cache.count("store_corrupt")
            self.store.delete([KEY_PREFIX + key])  # the next encode writes a good one
            return None
        self.cache.count("store_hits")
        return self.cache.put(
            key,
            got.tensor,
            got.ref.grid_thw,
            got.ref.modality,
            "store",
            got.ref.seconds_per_grid_t,
            got.ref.grid_t_timestamps,
        )

    def publish(self, key: str) -> bool:
        """Copy the node cache's entry of ``key`` to the store; False when it is not cached here."""
        data = self.cache.entry_bytes(key)
        if data is None:
            return False
        self.store.put([(KEY_PREFIX + key, data)], self.ttl_s)
        self.cache.count("store_puts")
        return True

    def claim(self, key: str) -> bool:
        """True when this node should encode ``key`` (nobody else is, as far as the store knows)."""
        return self.store.claim(CLAIM_PREFIX + key, self.claim_ttl_s)

    def unclaim(self, key: str) -> None:
        self.store.unclaim(CLAIM_PREFIX + key)

    async def wait_for(
        self, key: str, executor: Executor | None, timeout_s: float, interval_s: float = 0.05
    ) -> EmbeddingRef | None:
        """Poll the store for a value another node is computing (it holds the claim), for at most
        ``timeout_s``; the polls run on ``executor``, the waiting on the event loop."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            await asyncio.sleep(interval_s)
            exists = await loop.run_in_executor(executor, self.store.exists, [KEY_PREFIX + key])
            if exists[0]:
                return await loop.run_in_executor(executor, self.lookup, key)
        return None
