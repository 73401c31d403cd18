"""The shared store below the node cache: an embedding published by one node is found by another
byte for byte; a corrupt or truncated value is detected, dropped and counted; a dead store is a
miss, never an error; claims make one node encode while the other waits."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch

from encoder.caches.embed_cache import EmbedCache
from encoder.caches.embedding_tier import KEY_PREFIX, EmbeddingTier
from epd_common.store.disk_store import DiskStore
from epd_common.store.guarded import GuardedStore
from epd_common.store.local_redis import LocalRedis
from epd_common.store.redis_store import RedisStore

KEY = "ab" * 32


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with LocalRedis(maxmemory_bytes=64 << 20) as s:
        yield s


def node(tmp_path: Path, name: str) -> EmbedCache:
    return EmbedCache(namespace=f"tier-{name}", capacity_bytes=64 << 20, root=tmp_path / name)


def video(cache: EmbedCache, key: str = KEY) -> torch.Tensor:
    t = torch.randn(12, 32, generator=torch.Generator().manual_seed(1))
    cache.put(key, t, [(2, 4, 6)], "video", "encoder:1", 1.5, (0.25, 1.75))
    return t


@pytest.mark.parametrize("kind", ["redis", "disk"])
def test_one_nodes_embedding_is_another_nodes_hit(
    tmp_path: Path, kind: str, request: pytest.FixtureRequest
) -> None:
    if kind == "redis":
        raw = RedisStore(request.getfixturevalue("server").url)
    else:
        raw = DiskStore(tmp_path / "store", 16 << 20)
    store = GuardedStore(raw)
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    want = video(a)
    tier_a, tier_b = EmbeddingTier(store, a, ttl_s=60), EmbeddingTier(store, b, ttl_s=60)
    assert tier_b.lookup(KEY) is None  # nothing published yet
    assert tier_a.publish(KEY)
    ref = tier_b.lookup(KEY)
    assert ref is not None and ref.seconds_per_grid_t == 1.5 and ref.grid_t_timestamps == (0.25, 1.75)
    got = b.get(KEY)
    assert got is not None and torch.equal(got.tensor, want)
    assert got.tensor.numpy().tobytes() == want.numpy().tobytes()
    s = b.stats()
    assert (s.store_hits, s.store_misses) == (1, 1) and a.stats().store_puts == 1
    store.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "other_key"])
def test_a_damaged_value_is_a_counted_miss_and_is_dropped(
    tmp_path: Path, server: LocalRedis, damage: str
) -> None:
    store = GuardedStore(RedisStore(server.url))
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    video(a)
    EmbeddingTier(store, a).publish(KEY)
    r = redis.Redis.from_url(server.url)
    value = bytearray(r.get(KEY_PREFIX + KEY) or b"")
    if damage == "flip":
        value[-5] ^= 0xFF  # in the payload: only its crc can tell
    elif damage == "truncate":
        value = value[: len(value) // 2]
    else:  # a well-formed entry, but of another key
        video(a, "cd" * 32)
        value = bytearray(a.entry_bytes("cd" * 32) or b"")
    r.set(KEY_PREFIX + KEY, bytes(value))
    tier_b = EmbeddingTier(store, b)
    assert tier_b.lookup(KEY) is None
    assert b.stats().store_corrupt == 1 and not b.contains(KEY)
    assert r.get(KEY_PREFIX + KEY) is None  # dropped: the next encode's publish replaces it
    EmbeddingTier(store, a).publish(KEY)
    assert tier_b.lookup(KEY) is not None
    r.close()
    store.close()


def test_a_dead_store_is_a_miss_and_comes_back(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    own = LocalRedis(maxmemory_bytes=16 << 20)
    own.start()
    store = GuardedStore(RedisStore(own.url), retry_after_s=0.2)
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    video(a)
    tier_a, tier_b = EmbeddingTier(store, a), EmbeddingTier(store, b)
    assert tier_a.publish(KEY)
    own.stop()
    assert tier_b.lookup(KEY) is None and not store.up  # a miss, not an error
    assert tier_a.publish(KEY)  # no raise either
    assert tier_a.claim(KEY)  # a down store lets the node encode
    own.start()  # the same port
    asyncio.run(asyncio.sleep(0.3))
    assert tier_a.publish(KEY) and store.up
    assert tier_b.lookup(KEY) is not None
    store.close()
    own.stop()


def test_a_claim_makes_the_other_node_wait_for_the_value(tmp_path: Path, server: LocalRedis) -> None:
    store = GuardedStore(RedisStore(server.url))
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    tier_a, tier_b = EmbeddingTier(store, a, claim_ttl_s=5), EmbeddingTier(store, b, claim_ttl_s=5)
    key = "ef" * 32
    assert tier_a.claim(key) and not tier_b.claim(key)

    async def both() -> object:
        waiter = asyncio.create_task(tier_b.wait_for(key, None, timeout_s=5.0))
        await asyncio.sleep(0.3)
        video(a, key)
        tier_a.publish(key)
        tier_a.unclaim(key)
        return await waiter

    ref = asyncio.run(both())
    assert ref is not None and b.contains(key)
    assert tier_b.claim(key)  # released
    store.close()
