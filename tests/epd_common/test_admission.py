"""The expected-wait estimate: seeded until measured, measured over busy time only."""

from __future__ import annotations

import pytest

from epd_common.admission import ServiceRate, retry_after_header


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
    for visit, t0 in enumerate((600.0, 900.0)):  # two at a time, 0.1 s apart, idle in between
        rate.started(now=t0)
        rate.started(now=t0)
        rate.finished(now=t0 + 0.1)  # a sample: 0.1 s of busy time
        rate.finished(now=t0 + 0.2)  # alone: not one
        assert rate.in_flight == 0, visit
    assert rate.per_s() == pytest.approx(10.0)


def test_failed_items_are_not_samples() -> None:
    rate = ServiceRate(seed_per_s=3.0, min_samples=1)
    for _ in range(5):
        rate.started(now=0.0)
    for t in range(4):  # bad inputs refused in a millisecond would claim 1000 items/s
        rate.finished(now=0.001 * (t + 1), ok=False)
    assert rate.per_s() == 3.0


def test_finished_without_started_is_a_bug() -> None:
    with pytest.raises(AssertionError):
        ServiceRate(1.0).finished(now=0.0)


@pytest.mark.parametrize(("wait", "header"), [(0.0, "1"), (0.2, "1"), (1.0, "1"), (1.01, "2"), (7.5, "8")])
def test_retry_after_is_whole_seconds_rounded_up(wait: float, header: str) -> None:
    assert retry_after_header(wait) == header
