"""The expected-wait estimate: seeded until measured, measured over busy time only."""

from __future__ import annotations

import pytest

from epd_common.admission import Lateness, ServiceRate, request_deadline_s, retry_after_header


def test_the_seed_holds_until_enough_completions() -> None:
    rate = ServiceRate(seed_per_s=20.0, min_samples=4)
    assert rate.expected_wait_s(40) == pytest.approx(2.0)
    for _ in range(4):
        rate.started(now=0.0)
    for t in range(3):  # three completions with company: three samples
        rate.finished(now=0.5 * (t + 1))
    assert rate.per_s() == 20.0


def test_a_pipelined_stage_is_measured_by_its_completion_spacing() -> None:
    rate = ServiceRate(seed_per_s=1.0, min_samples=4)
    # 11 items admitted at once at t = 0, done every 0.1 s: 10 items/s whatever each one's latency
    for _ in range(11):
        rate.started(now=0.0)
    for i in range(11):
        rate.finished(now=0.1 * (i + 1))
    assert rate.per_s() == pytest.approx(10.0)  # the last one, alone by then, is not a sample
    assert rate.expected_wait_s(50) == pytest.approx(5.0)


def test_lone_items_and_idle_time_are_not_samples() -> None:
    rate = ServiceRate(seed_per_s=7.0, min_samples=2)
    for t0 in (0.0, 100.0, 500.0):  # one item at a time, long idle gaps: latency, not throughput
        rate.started(now=t0)
        rate.finished(now=t0 + 0.25)
    assert rate.per_s() == 7.0
    for visit, t0 in enumerate((600.0, 900.0)):  # three at a time, 0.1 s apart, idle in between
        for _ in range(3):
            rate.started(now=t0)
        rate.finished(now=t0 + 0.5)  # the first of a busy period: its latency, not a sample
        rate.finished(now=t0 + 0.6)  # a sample: 0.1 s of busy time
        rate.finished(now=t0 + 0.7)  # alone: not one
        assert rate.in_flight == 0, visit
    assert rate.per_s() == pytest.approx(10.0)


def test_failed_items_are_not_samples() -> None:
    rate = ServiceRate(seed_per_s=3.0, min_samples=1)
    for _ in range(5):
        rate.started(now=0.0)
    for t in range(4):  # bad inputs refused in a millisecond would claim 1000 items/s
        rate.finished(now=0.001 * (t + 1), ok=False)
    assert rate.per_s() == 3.0


def test_failures_between_completions_do_not_shorten_their_spacing() -> None:
    # A full queue refusing items between two completions: the stage still took 1 s per item.
    rate = ServiceRate(seed_per_s=100.0, min_samples=1)
    for _ in range(14):
        rate.started(now=0.0)
    rate.finished(now=1.0)  # the first of the busy period: its latency
    for t in range(2, 6):
        for k in range(1, 3):
            rate.finished(now=t - 1 + 0.3 * k, ok=False)  # refused at t-0.7 and t-0.4
        rate.finished(now=float(t))  # a sample: 1 s of busy time since the last completion
    assert rate.per_s() == pytest.approx(1.0)


def test_finished_without_started_is_a_bug() -> None:
    with pytest.raises(AssertionError):
        ServiceRate(1.0).finished(now=0.0)


@pytest.mark.parametrize(("wait", "header"), [(0.0, "1"), (0.2, "1"), (1.0, "1"), (1.01, "2"), (7.5, "8")])
def test_retry_after_is_whole_seconds_rounded_up(wait: float, header: str) -> None:
    assert retry_after_header(wait) == header


def test_units_weigh_completions() -> None:
    rate = ServiceRate(seed_per_s=1.0, min_samples=2)
    for _ in range(4):
        rate.started(now=0.0)
    rate.finished(now=0.5, units=16)  # the first of the busy period: not a sample
    rate.finished(now=0.6, units=64)  # a large item
    rate.finished(now=0.7, units=16)  # a small one
    rate.finished(now=0.8, units=16)  # alone: not a sample
    assert rate.per_s() == pytest.approx(80 / 0.2)


def test_a_stage_that_times_its_steps_observes_directly() -> None:
    rate = ServiceRate(seed_per_s=5.0, min_samples=2)
    rate.observe(0, 0.1)  # an empty step says nothing
    rate.observe(100, 0.0)
    assert not rate.measured
    rate.observe(300, 0.1)
    rate.observe(100, 0.1)
    assert rate.measured and rate.per_s() == pytest.approx(2000.0)


@pytest.mark.parametrize(
    ("headers", "deadline"),
    [
        ({}, 10.0),
        ({"x-request-timeout": "2.5"}, 2.5),
        ({"x-stainless-read-timeout": "600"}, 10.0),  # a longer client timeout is not the queue's
        ({"x-stainless-read-timeout": "3"}, 3.0),
        ({"x-request-timeout": "soon"}, 10.0),
        ({"x-request-timeout": "-1"}, 10.0),
        ({"x-request-timeout": "nan"}, 10.0),
        ({"x-request-timeout": "inf"}, 10.0),
    ],
)
def test_the_deadline_is_the_servers_or_the_clients_shorter_timeout(
    headers: dict[str, str], deadline: float
) -> None:
    assert request_deadline_s(headers, 10.0) == deadline


def test_old_samples_age_out_but_a_slow_stage_keeps_its_last_few() -> None:
    rate = ServiceRate(seed_per_s=1.0, min_samples=2, max_age_s=5.0)
    for i in range(10):  # 10 units/s, long ago
        rate.observe(1, 0.1, now=float(i))
    for i in range(10):  # 100 units/s now: the old ones drop out
        rate.observe(10, 0.1, now=100.0 + i * 0.1)
    assert rate.per_s() == pytest.approx(100.0)
    rate.observe(1, 1.0, now=1000.0)  # a slow stage: the newest two count, however old
    assert rate.per_s() == pytest.approx(11 / 1.1)


def test_a_batch_delivered_one_by_one_is_one_sample() -> None:
    rate = ServiceRate(seed_per_s=50.0, min_samples=4)
    for _ in range(453):  # a burst: a batch of 2, then batches of 150 taking 1.5 s each
        rate.started(now=0.0)
    rate.finished(now=0.1)  # the first batch: its first is the latency, its second one clump
    rate.finished(now=0.1001)
    for i in range(4):  # the first four of the next batch, delivered 0.1 ms apart
        rate.finished(now=1.6 + 1e-4 * i)
    # two clumps so far: the seed, not 4 items over 1.5 s (2.7 items/s: 447 queued read as 166 s)
    assert not rate.measured and rate.per_s() == 50.0
    for i in range(4, 150):
        rate.finished(now=1.6 + 1e-4 * i)
    for k in (1, 2):
        for i in range(150):
            rate.finished(now=1.6 + 1.5 * k + 1e-4 * i)
    assert rate.measured and rate.in_flight == 1
    assert rate.per_s() == pytest.approx(451 / 4.5, rel=0.02)  # the stage's rate: 100 items/s


def test_steady_completions_are_samples_each() -> None:
    rate = ServiceRate(seed_per_s=1.0, min_samples=4)
    for _ in range(6):
        rate.started(now=0.0)
    for i in range(6):  # 1000 items/s, spaced evenly: not a clump
        rate.finished(now=0.001 * (i + 1))
    assert rate.measured and rate.per_s() == pytest.approx(1000.0)


def test_lateness_scales_the_wait_by_the_late_tail_and_retry_after_by_the_median() -> None:
    late = Lateness(min_known=8)
    assert late.scaled(4.0) == 4.0  # nothing known yet: the estimate as it is
    # 99 items done on time, one 2.5x late: the tail (99th percentile) is what admission bounds
    for i, ratio in enumerate([1.0] * 90 + [1.5] * 9 + [2.5]):
        late.admitted(i, 2.0, now=0.0)
        late.done(i, now=2.0 * ratio)
    assert late.scale(0.5) == [1.0]
    assert late.scaled(4.0) == pytest.approx(4.0 * 1.5)  # the window holds the newest 64
    assert late.typical(4.0) == 4.0


def test_lateness_learns_from_measured_waits_only() -> None:
    late = Lateness(min_known=2)
    late.admitted("short", 0.1, now=0.0)  # below MIN_ESTIMATE_S: a fixed cost, not a queue
    late.done("short", now=1.0)
    late.admitted("aborted", 1.0, now=0.0)
    late.ended("aborted")
    late.done("aborted", now=9.0)  # ended: nothing pending to learn from
    late.done("never-admitted", now=9.0)
    assert late.scaled(1.0) == 1.0
    for token in ("a", "b"):
        late.admitted(token, 1.0, now=0.0)
        late.done(token, now=5.0)  # 5x late: capped at 3 (a wild estimate must not refuse all)
    assert late.scaled(1.0) == 3.0


def test_early_work_never_shrinks_the_wait() -> None:
    late = Lateness(min_known=1)
    late.admitted("fast", 4.0, now=0.0)
    late.done("fast", now=1.0)
    assert late.scaled(2.0) == 2.0 and late.typical(2.0) == 2.0
