"""A real ``redis-server`` on loopback for the store tests, started by ``LocalRedis``.

``redis_server`` is shared by a test module (tests keep to their own key namespace, ``ns``);
``own_redis`` is a server of the test's own, for the tests that kill, stop or restart it.
Without the Debian package (``apt-get install redis-server``) these tests are skipped.
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator

import pytest

from epd_common.store.local_redis import LocalRedis

needs_redis = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is not installed (apt-get install redis-server)",
)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with LocalRedis(maxmemory_bytes=64 << 20) as server:
        yield server


@pytest.fixture
def own_redis() -> Iterator[LocalRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    server = LocalRedis(maxmemory_bytes=64 << 20)
    yield server
    server.stop()


@pytest.fixture
def ns() -> str:
    """A key prefix no other test uses: ``epd:t<hex>/``."""
    return f"epd:t{secrets.token_hex(4)}/"
