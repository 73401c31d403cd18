"""The server pool on its own: liveness, the refusal countdown and failover, with a policy that
takes the candidates in order and a classifier over plain exceptions."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import NamedTuple

import pytest

from epd.server_pool import (
    AllAttemptsFailed,
    AttemptFailure,
    Liveness,
    NoServerAvailable,
    Outcome,
    PassedBy,
    PoolConfig,
    RefusalClock,
    ServerPool,
    Verdict,
)
from epd.server_pool.attempts import FAILED, FATAL, UNREACHABLE, refused

URLS = ["http://a", "http://b", "http://c"]


class Pick(NamedTuple):
    url: str


class InOrder:
    """The first candidate, as listed."""

    def choose(self, request: str, candidates: Sequence[str]) -> Pick:
        return Pick(candidates[0])


class Busy(Exception):
    def __init__(self, wait_s: float) -> None:
        super().__init__(f"busy for {wait_s} s")
        self.wait_s = wait_s


class Gone(Exception):
    pass


class Flaky(Exception):
    pass


def classify(error: BaseException) -> Verdict:
    if isinstance(error, Busy):
        return refused(error.wait_s)
    if isinstance(error, Gone):
        return UNREACHABLE
    if isinstance(error, Flaky):
        return FAILED
    return FATAL


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_pool(
    config: PoolConfig | None = None, liveness: Liveness | None = None, **kw: object
) -> ServerPool[str, Pick]:
    live = liveness or Liveness(URLS, label="server")
    return ServerPool(live, InOrder(), classify, config or PoolConfig("server"), **kw)  # type: ignore[arg-type]


def run_with(
    pool: ServerPool[str, Pick], errors: dict[str, Exception], deadline_s: float | None = None
) -> tuple[str, list[str]]:
    tried: list[str] = []

    async def fn(pick: Pick) -> str:
        tried.append(pick.url)
        if pick.url in errors:
            raise errors[pick.url]
        return pick.url

    return asyncio.run(pool.call("req", fn, deadline_s)), tried


def test_health_checks_flip_a_server_after_enough_results_in_a_row() -> None:
    live = Liveness(URLS, label="server", fall_after=2, rise_after=2)
    live.report(URLS[0], False)
    assert live.is_up(URLS[0])
    live.report(URLS[0], False)
    assert not live.is_up(URLS[0])
    live.report(URLS[0], True)
    assert not live.is_up(URLS[0])
    live.report(URLS[0], True)
    assert live.is_up(URLS[0])
    live.report("http://unknown", False)  # removed meanwhile: ignored
    with pytest.raises(KeyError):
        live.set("http://unknown", True)


def test_a_listener_hears_every_mark() -> None:
    live = Liveness(URLS, label="server", initially_up=False)
    heard: list[tuple[str, bool]] = []
    live.subscribe(lambda url, up: heard.append((url, up)))
    live.set(URLS[1], False)
    live.set(URLS[1], True)
    assert heard == [(URLS[1], False), (URLS[1], True)]
    assert live.up_among(URLS) == [URLS[1]]
    live.report(URLS[0], False)  # a health result, unchanged: heard too (a gauge is set from it)
    assert heard[-1] == (URLS[0], False)


def test_the_refusal_countdown() -> None:
    clock = Clock()
    refusals = RefusalClock(clock)
    refusals.note(URLS[0], 5.0)
    clock.now += 2.0
    assert refusals.wait_s(URLS[0]) == pytest.approx(3.0)
    assert refusals.least(URLS[:2]) == 0.0  # b never refused
    clock.now += 10.0
    assert refusals.wait_s(URLS[0]) == 0.0


def test_failover_takes_an_unreachable_server_out_and_keeps_a_failing_one() -> None:
    pool = make_pool()
    out, tried = run_with(pool, {URLS[0]: Gone(), URLS[1]: Flaky()})
    assert (out, tried) == (URLS[2], URLS)
    assert pool.live_members == URLS[1:]


def test_a_fatal_error_is_raised_at_once() -> None:
    pool = make_pool()
    with pytest.raises(ValueError):
        run_with(pool, {URLS[0]: ValueError("bad request")})
    assert pool.live_members == URLS


def test_every_server_refusing_names_the_shortest_wait_and_the_waits_count_down() -> None:
    clock = Clock()
    pool = make_pool(refusals=RefusalClock(clock))
    with pytest.raises(AllAttemptsFailed) as info:
        run_with(pool, {URLS[0]: Busy(7.0), URLS[1]: Busy(3.0), URLS[2]: Busy(12.0)})
    assert info.value.retry_after_s == 3.0
    assert [a.verdict.outcome for a in info.value.attempts] == [Outcome.REFUSED] * 3
    assert pool.live_members == URLS  # a refusal for load takes no server out
    clock.now += 1.0
    assert pool.expected_wait_s() == pytest.approx(2.0)


def test_a_refused_server_is_passed_by_only_when_the_pool_is_so_configured() -> None:
    for pass_by, sent in ((True, [URLS[1]]), (False, URLS[:2])):
        pool = make_pool(PoolConfig("server", pass_by_refused=pass_by))
        pool.refusals.note(URLS[0], 20.0)
        out, tried = run_with(pool, {URLS[0]: Busy(20.0)}, deadline_s=5.0)
        assert (out, tried) == (URLS[1], sent)


def test_a_passed_by_server_counts_as_a_refusal_and_keeps_its_countdown() -> None:
    clock = Clock()
    pool = make_pool(PoolConfig("server", pass_by_refused=True, max_attempts=1), refusals=RefusalClock(clock))
    pool.refusals.note(URLS[0], 20.0)
    clock.now += 5.0
    with pytest.raises(AllAttemptsFailed) as info:
        run_with(pool, {}, deadline_s=5.0)
    (attempt,) = info.value.attempts
    assert isinstance(attempt.error, PassedBy) and info.value.retry_after_s == pytest.approx(15.0)
    assert pool.refusals.wait_s(URLS[0]) == pytest.approx(15.0)  # not noted again


def test_all_down_fails_at_once_or_tries_all_as_configured() -> None:
    for tries_all in (False, True):
        pool = make_pool(PoolConfig("server", all_down_tries_all=tries_all))
        for u in URLS:
            pool.liveness.set(u, False)
        if tries_all:
            assert run_with(pool, {}) == (URLS[0], [URLS[0]])
        else:
            with pytest.raises(NoServerAvailable, match="all 3 servers are down"):
                run_with(pool, {})


def test_max_attempts_caps_the_servers_one_call_tries() -> None:
    pool = make_pool(PoolConfig("server", max_attempts=2))
    with pytest.raises(AllAttemptsFailed) as info:
        run_with(pool, {u: Flaky() for u in URLS})
    assert [a.url for a in info.value.attempts] == URLS[:2]


def test_the_failure_hook_says_whether_the_call_moves_on() -> None:
    seen: list[tuple[str, Outcome, bool]] = []

    def hook(failure: AttemptFailure, moving_on: bool) -> None:
        seen.append((failure.url, failure.verdict.outcome, moving_on))

    pool = make_pool(on_failure=hook)
    with pytest.raises(AllAttemptsFailed):
        run_with(pool, {URLS[0]: Gone(), URLS[1]: Busy(1.0), URLS[2]: Gone()})
    assert seen == [
        (URLS[0], Outcome.UNREACHABLE, True),
        (URLS[1], Outcome.REFUSED, True),
        (URLS[2], Outcome.UNREACHABLE, False),
    ]


def test_pools_over_parts_of_one_liveness_see_each_others_marks() -> None:
    """Split roles: the prefill pool (a, b) and the decode pool (b, c) share b's state, and a
    pool's failover counts only its own members."""
    live = Liveness(URLS, label="server")
    moved: list[bool] = []
    first = make_pool(liveness=live, members=URLS[:2], on_failure=lambda f, on: moved.append(on))
    second = make_pool(liveness=live, members=URLS[1:])
    live.set(URLS[1], False)
    with pytest.raises(AllAttemptsFailed):
        run_with(first, {URLS[0]: Gone()})
    assert moved == [False]  # c is live, but no member of the first pool
    assert second.live_members == [URLS[2]]
    with pytest.raises(ValueError):
        make_pool(liveness=live, members=["http://elsewhere"])
