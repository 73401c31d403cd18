"""bench.kv_tiers on a short history: the host tier copies the history back, the engine sharing
Redis fetches it, and all give the recomputed greedy ids (the figures themselves are not asserted)."""

from __future__ import annotations

from bench.kv_tiers import run_length
from epd_common.store.local_redis import LocalRedis
from tests.epd_common.store.conftest import needs_redis


@needs_redis
def test_a_short_run_restores_the_history_and_agrees_with_recompute() -> None:
    with LocalRedis(maxmemory_bytes=256 << 20) as server:
        row = run_length(512, 1, 0, server.url)
    assert row["identical"] is True
    pages = (512 - 16) // 16  # the whole history but its last partial page
    assert row["host_tier_tiers"]["host"]["restored_tokens"] >= pages * 16
    assert row["redis_tiers"]["store"]["fetched_pages"] >= pages
    assert row["redis_tiers"]["host"]["restored_tokens"] >= pages * 16
    assert row["tiny_bytes_swa_aware"] < row["tiny_bytes_all_layers"]
