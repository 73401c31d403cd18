"""Core placement of a local vLLM and epd's side (epd/placement.py)."""

from __future__ import annotations

import shutil

import pytest

from epd.placement import CpuSplit, cpu_list, parse_cpus, pinned_argv, plan_split


def test_core_lists_round_trip() -> None:
    assert parse_cpus("0-3,6, 8-9") == (0, 1, 2, 3, 6, 8, 9)
    assert cpu_list((9, 0, 1, 2, 3, 6, 8)) == "0-3,6,8-9"
    for bad in ("", "a", "3-1", "-1"):
        with pytest.raises(ValueError, match="not a core list"):
            parse_cpus(bad)


def test_auto_gives_vllm_the_upper_half_and_epd_the_rest() -> None:
    assert plan_split("auto", {0, 1}) == CpuSplit((1,), (0,))
    assert plan_split("auto", set(range(16))) == CpuSplit(tuple(range(8, 16)), tuple(range(8)))
    assert plan_split("auto", {3, 5, 7}) == CpuSplit((5, 7), (3,))
    assert plan_split("auto", {0}) is None and plan_split("off", {0, 1}) is None


def test_an_explicit_split_is_checked_against_the_usable_cores() -> None:
    assert plan_split("2-3:0-1", {0, 1, 2, 3}) == CpuSplit((2, 3), (0, 1))
    with pytest.raises(ValueError, match="cannot use"):
        plan_split("4:0", {0, 1})
    with pytest.raises(ValueError, match="auto, off or"):
        plan_split("1", {0, 1})


@pytest.mark.skipif(shutil.which("taskset") is None, reason="no taskset")
def test_a_pinned_child_runs_under_taskset() -> None:
    argv = pinned_argv(("python", "-m", "x"), (2, 3))
    assert argv[1:] == ("-c", "2-3", "python", "-m", "x") and argv[0].endswith("taskset")
    assert pinned_argv(("python",), ()) == ("python",)  # no cores named: anywhere
