"""The key rule, the argument checks every store shares, and ``open_store``'s parsing of the CLI."""

from __future__ import annotations

import pytest

from epd_common.store import MAX_KEY_LEN, StoreError, check_key, open_store
from epd_common.store.disk_store import DiskStore
from epd_common.store.redis_store import RedisStore, public_url, redis_url
from epd_common.store.store import check_items, check_keys, check_ttl


@pytest.mark.parametrize(
    "key",
    [
        "epd:a",
        "epd:emb/Qwen/Qwen2-VL-2B/3f2a/bfloat16/ab12",
        "kv-1:m.v=2+x@y:z",
        "e:" + "x" * (MAX_KEY_LEN - 2),
    ],
)
def test_valid_keys(key: str) -> None:
    assert check_key(key) == key


@pytest.mark.parametrize(
    "key",
    [
        "",
        "nonamespace",
        ":x",
        "1ns:x",
        "epd:",
        "epd:a b",
        "epd:a#claim",
        "epd:\u00e9",
        "epd:a\n",
        "e:" + "x" * MAX_KEY_LEN,
        7,
        None,
        b"epd:a",
    ],
)
def test_invalid_keys(key: object) -> None:
    with pytest.raises(StoreError) as e:
        check_key(key)
    assert e.value.reason == "invalid"
    assert repr(key)[:20] in str(e.value)


def test_a_bare_string_is_not_a_key_list() -> None:
    with pytest.raises(StoreError, match="sequence of keys"):
        check_keys("epd:a")


def test_items_are_checked_before_anything() -> None:
    assert check_items([("epd:a", b"x"), ("epd:b", bytearray(b"yz"))], 2)[1][1] == b"yz"
    with pytest.raises(StoreError) as e:
        check_items([("epd:a", b"x"), ("epd:b", b"xyz")], 2)
    assert e.value.reason == "too_large" and "epd:b" in str(e.value)
    with pytest.raises(StoreError, match="must be bytes"):
        check_items([("epd:a", "text")], 10)  # type: ignore[list-item]
    strided = memoryview(bytearray(8))[::2]
    with pytest.raises(StoreError, match="contiguous"):
        check_items([("epd:a", strided)], 10)
    with pytest.raises(StoreError, match="pairs"):
        check_items(["epd:a"], 10)  # type: ignore[list-item]


@pytest.mark.parametrize("ttl", [0, -1, float("inf"), float("nan"), True, "5"])
def test_bad_ttls(ttl: object) -> None:
    with pytest.raises(StoreError) as e:
        check_ttl(ttl)  # type: ignore[arg-type]
    assert e.value.reason == "invalid"


def test_ttl_none_only_where_allowed() -> None:
    assert check_ttl(None) is None and check_ttl(2) == 2.0
    with pytest.raises(StoreError):
        check_ttl(None, required=True)


def test_open_store_picks_the_tier(tmp_path) -> None:
    assert open_store(None, None, 1 << 20) is None
    disk = open_store(None, str(tmp_path), 1 << 20)
    assert isinstance(disk, DiskStore) and disk.max_bytes == 1 << 20
    for url in ("redis://127.0.0.1:6379/0", "rediss://h:6380", "valkey://h:6379/2", "redis://:pw@h:1/0"):
        store = open_store(url, None, 0)
        assert isinstance(store, RedisStore) and store.url == url


@pytest.mark.parametrize(
    ("spec", "directory", "message"),
    [
        ("redis://h:1", "/tmp/x", "exclude each other"),
        ("local", None, "serve command"),
        ("http://h:1", None, "unknown scheme"),
        ("h:6379", None, "unknown scheme"),
        ("redis://:6379", None, "no host"),
        ("redis://h", None, "no port"),
        ("redis://h:notaport", None, "not a valid URL"),
        ("redis://h:1/zero", None, "database number"),
        ("redis://h:1/0?x=1", None, "query"),
    ],
)
def test_open_store_refuses(spec: str, directory: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        open_store(spec, directory, 1 << 20)


def test_open_store_needs_a_disk_budget(tmp_path) -> None:
    with pytest.raises(ValueError, match="positive byte budget"):
        open_store(None, str(tmp_path), 0)


def test_urls() -> None:
    assert redis_url("valkey://h:1/0") == "redis://h:1/0"
    assert redis_url("valkeys://h:1/0") == "rediss://h:1/0"
    assert public_url("redis://:secret@h:1/0") == "redis://:***@h:1/0"
    assert public_url("redis://user:secret@h:1/0") == "redis://user:***@h:1/0"
    assert public_url("redis://h:1/0") == "redis://h:1/0"
