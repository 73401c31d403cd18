"""RedisStore against a real redis-server on loopback: round trips, TTL, claims, limits, and the
faults of issue #19: a killed and restarted server, a stopped (slow) one, one that never answers."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from epd_common.store import StoreError
from epd_common.store.local_redis import LocalRedis, free_port
from epd_common.store.redis_store import RedisStore


def raises_within(reason: str, seconds: float, call) -> float:
    """Assert ``call()`` raises ``StoreError(reason)`` within ``seconds``; returns the time taken."""
    t0 = time.monotonic()
    with pytest.raises(StoreError) as e:
        call()
    elapsed = time.monotonic() - t0
    assert e.value.reason == reason, e.value
    assert elapsed < seconds, f"{reason} after {elapsed:.3f} s"
    return elapsed


def test_round_trip_batch(redis_server: LocalRedis, ns: str) -> None:
    s = RedisStore(redis_server.url)
    keys = [f"{ns}{i}" for i in range(4)]
    s.put(
        [(keys[0], b"\x00\xff" * 10), (keys[1], bytearray(b"b")), (keys[2], memoryview(b"")), (keys[3], b"d")]
    )
    assert s.exists([*keys, f"{ns}none"]) == [True, True, True, True, False]
    assert s.get([keys[2], f"{ns}none", keys[0], keys[1]]) == [b"", None, b"\x00\xff" * 10, b"b"]
    s.put([(keys[0], b"new")])
    assert s.get([keys[0]]) == [b"new"]
    s.delete([keys[0], keys[3], f"{ns}none"])
    assert s.exists(keys) == [False, True, True, False]
    assert s.get([]) == [] and s.exists([]) == []
    s.put([])
    st = s.stats()
    assert (st.kind, st.location, st.hits, st.misses, st.errors, st.puts) == (
        "redis",
        redis_server.url,
        4,
        1,
        0,
        5,
    )
    assert st.entries >= 2 and st.bytes > 0


def test_valkey_scheme(redis_server: LocalRedis, ns: str) -> None:
    s = RedisStore(redis_server.url.replace("redis://", "valkey://"))
    s.put([(f"{ns}v", b"1")])
    assert RedisStore(redis_server.url).get([f"{ns}v"]) == [b"1"]


def test_ttl_expiry(redis_server: LocalRedis, ns: str) -> None:
    s = RedisStore(redis_server.url)
    s.put([(f"{ns}short", b"s")], ttl_s=0.3)
    s.put([(f"{ns}long", b"l")], ttl_s=30)
    s.put([(f"{ns}forever", b"f")])
    assert s.exists([f"{ns}short", f"{ns}long", f"{ns}forever"]) == [True, True, True]
    raw = redis.Redis.from_url(redis_server.url)
    assert 0 < raw.pttl(f"{ns}short") <= 300 and raw.pttl(f"{ns}forever") == -1
    time.sleep(0.4)
    assert s.get([f"{ns}short", f"{ns}long", f"{ns}forever"]) == [None, b"l", b"f"]
    raw.close()


def test_claims(redis_server: LocalRedis, ns: str) -> None:
    a, b = RedisStore(redis_server.url), RedisStore(redis_server.url)
    key = f"{ns}k"
    assert a.claim(key, 5.0) is True
    assert a.claim(key, 5.0) is False and b.claim(key, 5.0) is False
    assert a.exists([key]) == [False]  # the marker is beside the key, not the key
    b.unclaim(key)  # not b's claim: no effect
    assert b.claim(key, 5.0) is False
    a.unclaim(key)
    assert b.claim(key, 0.2) is True
    time.sleep(0.3)  # b's claim lapsed
    assert a.claim(key, 5.0) is True
    b.unclaim(key)  # b's late unclaim leaves a's claim
    assert b.claim(key, 5.0) is False


def test_racing_claimers(redis_server: LocalRedis, ns: str) -> None:
    stores = [RedisStore(redis_server.url) for _ in range(8)]
    start = threading.Barrier(len(stores))
    won: list[bool] = []

    def race(s: RedisStore) -> None:
        start.wait()
        won.append(s.claim(f"{ns}k", 10.0))

    threads = [threading.Thread(target=race, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(won) == [False] * 7 + [True]


def test_too_large_sends_nothing(redis_server: LocalRedis, ns: str) -> None:
    s = RedisStore(redis_server.url, max_value_bytes=1000)
    with pytest.raises(StoreError) as e:
        s.put([(f"{ns}ok", b"x"), (f"{ns}big", b"x" * 1001)])
    assert e.value.reason == "too_large" and f"{ns}big" in str(e.value)
    assert s.exists([f"{ns}ok"]) == [False]
    s.put([(f"{ns}fits", b"x" * 1000)])


def test_invalid_calls(redis_server: LocalRedis) -> None:
    s = RedisStore(redis_server.url)
    for call in (
        lambda: s.get(["nonamespace"]),
        lambda: s.put([("epd:a", b"x")], ttl_s=-1),
        lambda: s.exists("epd:a"),
    ):
        with pytest.raises(StoreError) as e:
            call()
        assert e.value.reason == "invalid"
    s.close()
    with pytest.raises(StoreError) as e:
        s.get(["epd:a"])
    assert e.value.reason == "unavailable"


def test_a_forked_child_uses_its_own_connections(redis_server: LocalRedis, ns: str) -> None:
    s = RedisStore(redis_server.url)
    s.put([(f"{ns}p", b"parent")])
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's pooled socket must not be shared
        try:
            s.put([(f"{ns}c", b"child")])
            ok = s.get([f"{ns}p"]) == [b"parent"]
            os.write(write, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.close(read)
    os.waitpid(pid, 0)
    assert s.get([f"{ns}c", f"{ns}p"]) == [b"child", b"parent"]


def test_killed_then_restarted_server(own_redis: LocalRedis, ns: str) -> None:
    s = RedisStore(own_redis.url)
    s.put([(f"{ns}a", b"a")])
    port, pid = own_redis.port, own_redis.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    own_redis.stop()  # reaps it
    for call in (lambda: s.get([f"{ns}a"]), lambda: s.exists([f"{ns}a"]), lambda: s.put([(f"{ns}b", b"b")])):
        raises_within("unavailable", 1.0, call)
    raises_within("unavailable", 1.0, lambda: s.claim(f"{ns}a", 1.0))
    raises_within("unavailable", 1.0, s.stats)
    with LocalRedis(port=port):  # the same URL: the pool's dead connections are replaced
        assert s.get([f"{ns}a"]) == [None]  # no persistence: a restarted server is empty
        s.put([(f"{ns}a", b"again")])
        assert s.get([f"{ns}a"]) == [b"again"]
        assert s.stats().errors == 5


def test_stopped_server_times_out(own_redis: LocalRedis, ns: str) -> None:
    s = RedisStore(own_redis.url, timeout_s=0.25)
    s.put([(f"{ns}a", b"a")])
    assert own_redis.pid is not None
    os.kill(own_redis.pid, signal.SIGSTOP)  # a server that accepts but answers nothing
    try:
        elapsed = raises_within("timeout", 0.25 + 0.5, lambda: s.get([f"{ns}a"]))
        assert elapsed >= 0.2
        raises_within("timeout", 0.25 + 0.5, lambda: s.put([(f"{ns}b", b"b")]))
    finally:
        os.kill(own_redis.pid, signal.SIGCONT)
    assert s.get([f"{ns}a"]) == [b"a"]  # answers again once it runs


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose listener never accepts: the kernel completes connects, nobody ever answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock.getsockname()[1]
    sock.close()


def test_a_server_that_never_answers(silent_port: int) -> None:
    s = RedisStore(f"redis://127.0.0.1:{silent_port}/0", timeout_s=0.2)
    elapsed = raises_within("timeout", 0.2 + 0.5, lambda: s.exists(["epd:a"]))
    assert elapsed >= 0.15


def test_nothing_listening() -> None:
    s = RedisStore(f"redis://127.0.0.1:{free_port()}/0")
    raises_within("unavailable", 0.2, lambda: s.get(["epd:a"]))


def test_kill_and_restart_under_load(own_redis: LocalRedis, ns: str) -> None:
    """Calls in flight while the server dies and comes back: each returns the right bytes, a miss,
    or a StoreError; nothing else, and the calls work again after the restart."""
    s = RedisStore(own_redis.url)
    port = own_redis.port
    stop = threading.Event()
    outcomes: dict[str, int] = {"ok": 0, "unavailable": 0, "timeout": 0}
    wrong: list[object] = []

    def load() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            key, value = f"{ns}{i % 50}", f"value-{i % 50}".encode() * 100
            try:
                s.put([(key, value)])
                got = s.get([key, f"{ns}{(i + 1) % 50}"])
                for k, v in zip((i % 50, (i + 1) % 50), got, strict=True):
                    if v is not None and v != f"value-{k}".encode() * 100:
                        wrong.append(v[:20])
                outcomes["ok"] += 1
            except StoreError as e:
                outcomes[e.reason] += 1
            except Exception as e:  # anything but a StoreError is a bug
                wrong.append(e)

    worker = threading.Thread(target=load)
    worker.start()
    try:
        time.sleep(0.2)
        assert own_redis.pid is not None
        os.kill(own_redis.pid, signal.SIGKILL)
        own_redis.stop()
        time.sleep(0.2)
        down = outcomes["unavailable"]
        with LocalRedis(port=port):
            ok_before = outcomes["ok"]
            time.sleep(0.3)
            ok_after = outcomes["ok"]
    finally:
        stop.set()
        worker.join()
    assert wrong == []
    assert down > 0 and ok_after > ok_before


def test_a_damaged_value_reaches_the_callers_checks(redis_server: LocalRedis, ns: str) -> None:
    """The store hands back exactly what Redis holds; a node cache entry truncated or flipped
    inside Redis fails the entry format's checks (the tier's job), and a put replaces it."""
    from encoder.caches.cache_format import CorruptEntry, pack_header, parse_header, payload_crc

    payload = bytes(range(256)) * 16
    header = pack_header(
        key="img-1",
        dtype="float32",
        shape=(4, 256),
        grid_thw=((1, 2, 2),),
        modality="image",
        writer="test",
        created_ns=1,
        payload_crc=payload_crc(payload),
    )
    entry, key = header + payload, f"{ns}emb/img-1"

    def check(blob: bytes) -> None:
        h = parse_header(blob, len(blob))
        if payload_crc(blob[h.header_len :]) != h.payload_crc:
            raise CorruptEntry("payload crc")

    s = RedisStore(redis_server.url)
    s.put([(key, entry)])
    raw = redis.Redis.from_url(redis_server.url)
    raw.set(key, entry[:-100])  # truncated inside Redis
    (blob,) = s.get([key])
    assert blob == entry[:-100]
    with pytest.raises(CorruptEntry):
        check(blob)
    raw.set(key, entry[:-1] + bytes([entry[-1] ^ 1]))  # one payload bit flipped
    with pytest.raises(CorruptEntry, match="payload crc"):
        check(s.get([key])[0])  # type: ignore[arg-type]
    s.put([(key, entry)])  # recomputed: the bad value is replaced
    (blob,) = s.get([key])
    assert blob == entry
    check(blob)
    raw.close()
