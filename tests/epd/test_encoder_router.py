import asyncio
import hashlib
import json
import subprocess
import sys
from collections import Counter

import pytest

from epd.encoder_router import EncoderRouter, WorkerSpec, WorkerUnavailable
from epd.server_pool import AllAttemptsFailed, NoServerAvailable

URLS = [f"http://enc{i}:8001" for i in range(5)]
KEYS = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(20000)]


def mapping(router: EncoderRouter, keys: list[str] = KEYS) -> dict[str, str]:
    return {k: router.pick(k) for k in keys}


def test_adding_a_fifth_worker_moves_about_a_fifth_of_keys_all_to_it() -> None:
    router = EncoderRouter([WorkerSpec(u) for u in URLS[:4]])
    before = mapping(router)
    router.set_workers([WorkerSpec(u) for u in URLS])
    after = mapping(router)
    moved = [k for k in KEYS if before[k] != after[k]]
    assert 0.13 < len(moved) / len(KEYS) < 0.27
    assert {after[k] for k in moved} == {URLS[4]}


def test_removing_a_worker_moves_only_its_keys() -> None:
    router = EncoderRouter([WorkerSpec(u) for u in URLS])
    before = mapping(router)
    router.set_workers([WorkerSpec(u) for u in URLS if u != URLS[2]])
    after = mapping(router)
    for k in KEYS:
        if before[k] != URLS[2]:
            assert after[k] == before[k]
        else:
            assert after[k] != URLS[2]
    assert sum(1 for k in KEYS if before[k] == URLS[2]) > 0.1 * len(KEYS)


def test_weights_scale_the_share_of_keys() -> None:
    router = EncoderRouter([WorkerSpec(URLS[0], 2), WorkerSpec(URLS[1]), WorkerSpec(URLS[2])])
    share = Counter(mapping(router).values())
    assert 1.6 < share[URLS[0]] / share[URLS[1]] < 2.4
    assert 0.75 < share[URLS[1]] / share[URLS[2]] < 1.33


def test_mapping_is_identical_in_another_process() -> None:
    code = (
        "import hashlib, json\n"
        "from epd.encoder_router import EncoderRouter, WorkerSpec\n"
        f"r = EncoderRouter([WorkerSpec(u, w) for u, w in {list(zip(URLS, [1, 2, 1, 3, 1], strict=True))!r}])\n"
        "keys = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(3000)]\n"
        "print(json.dumps({k: r.ring_order(k) for k in keys}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "777", "PATH": "/usr/bin"},
    )
    here = EncoderRouter([WorkerSpec(u, w) for u, w in zip(URLS, [1, 2, 1, 3, 1], strict=True)])
    assert json.loads(out.stdout) == {k: here.ring_order(k) for k in KEYS[:3000]}


def test_ring_order_starts_at_the_owner_and_lists_each_live_worker_once() -> None:
    router = EncoderRouter([WorkerSpec(u) for u in URLS])
    for k in KEYS[:200]:
        order = router.ring_order(k)
        assert order[0] == router.pick(k) and sorted(order) == sorted(URLS)


def test_duplicate_and_invalid_specs_are_rejected() -> None:
    with pytest.raises(ValueError, match="twice"):
        EncoderRouter([WorkerSpec(URLS[0]), WorkerSpec(URLS[0])])
    with pytest.raises(ValueError, match="weight"):
        WorkerSpec(URLS[0], 0)
    with pytest.raises(NoServerAvailable):
        EncoderRouter([]).pick(KEYS[0])


def test_failed_call_retries_on_the_next_worker_of_the_ring() -> None:
    router = EncoderRouter([WorkerSpec(u) for u in URLS[:4]])
    key = KEYS[7]
    order = router.ring_order(key)
    tried: list[str] = []

    async def fn(url: str) -> str:
        tried.append(url)
        if url == order[0]:
            raise WorkerUnavailable(url, "HTTP 503", status=503)
        return f"embedded by {url}"

    assert asyncio.run(router.call(key, fn)) == f"embedded by {order[1]}"
    assert tried == order[:2]
    assert router.live_workers == URLS[:4]  # a 5xx is not a reason to take the worker out


def test_connection_failure_takes_the_worker_out_and_bad_media_is_not_retried() -> None:
    router = EncoderRouter([WorkerSpec(u) for u in URLS[:3]])
    key = KEYS[3]
    owner = router.pick(key)

    async def refuse(url: str) -> str:
        if url == owner:
            raise ConnectionRefusedError(f"connect to {url}")
        return url

    assert asyncio.run(router.call(key, refuse)) != owner
    assert owner not in router.live_workers and router.pick(key) != owner

    calls: list[str] = []

    async def bad_media(url: str) -> str:
        calls.append(url)
        raise ValueError("400: not an image")

    with pytest.raises(ValueError, match="not an image"):
        asyncio.run(router.call(KEYS[4], bad_media))
    assert len(calls) == 1


def test_all_workers_failing_reports_every_attempt() -> None:
    router = EncoderRouter([WorkerSpec(u) for u in URLS[:3]], max_attempts=2)

    async def down(url: str) -> str:
        raise WorkerUnavailable(url, "HTTP 500", status=500)

    with pytest.raises(AllAttemptsFailed) as info:
        asyncio.run(router.call(KEYS[0], down))
    assert [a.url for a in info.value.attempts] == router.ring_order(KEYS[0])[:2]


def test_a_refused_worker_passes_the_item_on_and_all_refusing_names_the_shortest_wait() -> None:
    router = EncoderRouter([WorkerSpec(u) for u in URLS[:3]])
    order = router.ring_order(KEYS[1])
    waits = dict(zip(order, (7.0, 3.0, 12.0), strict=True))
    tried: list[str] = []

    async def refuse(url: str) -> str:
        tried.append(url)
        raise WorkerUnavailable(url, "answered 503", status=503, retry_after_s=waits[url])

    with pytest.raises(AllAttemptsFailed) as info:
        asyncio.run(router.call(KEYS[1], refuse))
    assert tried == order  # the owner, then the rest of the ring
    assert info.value.retry_after_s == 3.0
    assert router.live_workers == URLS[:3]  # a refusal for load takes no worker out

    async def owner_refuses(url: str) -> str:
        if url == order[0]:
            raise WorkerUnavailable(url, "answered 503", status=503, retry_after_s=20.0)
        return url

    assert asyncio.run(router.call(KEYS[1], owner_refuses)) == order[1]


def test_single_flight_ten_concurrent_calls_one_encode() -> None:
    router = EncoderRouter([WorkerSpec(u) for u in URLS[:4]])
    encodes: list[str] = []

    async def encode(url: str) -> str:
        encodes.append(url)
        await asyncio.sleep(0.05)
        return f"ref from {url}"

    async def main() -> list[str]:
        results = await asyncio.gather(*(router.call(KEYS[1], encode) for _ in range(10)))
        assert router.inflight() == 0
        results.append(await router.call(KEYS[1], encode))  # after completion: a new encode
        return list(results)

    results = asyncio.run(main())
    assert len(encodes) == 2 and len(set(results)) == 1


def test_single_flight_shares_failures_and_survives_a_cancelled_waiter() -> None:
    router = EncoderRouter([WorkerSpec(u) for u in URLS[:2]])
    calls = 0

    async def slow(url: str) -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        return "done"

    async def boom(url: str) -> str:
        await asyncio.sleep(0.01)
        raise KeyError("bad")

    async def main() -> None:
        first = asyncio.ensure_future(router.call(KEYS[2], slow))
        second = asyncio.ensure_future(router.call(KEYS[2], slow))
        await asyncio.sleep(0.01)
        first.cancel()
        assert await second == "done" and calls == 1
        outcomes = await asyncio.gather(
            *(router.call(KEYS[5], boom) for _ in range(3)), return_exceptions=True
        )
        assert all(isinstance(o, KeyError) for o in outcomes)

    asyncio.run(main())


def test_health_checks_remove_and_readd_a_worker() -> None:
    router = EncoderRouter([WorkerSpec(u) for u in URLS[:4]], fall_after=2, rise_after=1)
    before = mapping(router, KEYS[:2000])
    dead = {URLS[1]}

    async def check(url: str) -> bool:
        if url in dead:
            raise ConnectionRefusedError(url)
        return True

    async def main() -> None:
        await router.check_all(check)
        assert URLS[1] in router.live_workers  # one failure is not enough with fall_after=2
        await router.check_all(check)
        assert URLS[1] not in router.live_workers
        assert URLS[1] not in set(mapping(router, KEYS[:2000]).values())
        dead.clear()
        await router.check_all(check)

    asyncio.run(main())
    assert router.live_workers == URLS[:4]
    assert mapping(router, KEYS[:2000]) == before  # keys come back to the healthy worker
