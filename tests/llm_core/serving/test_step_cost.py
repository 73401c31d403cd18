"""StepCost: the averages it learns from steps and the prefill budget that keeps a step with a
chunk within its target, against the arithmetic written out here."""

from __future__ import annotations

import pytest

from llm_core.serving.step_cost import ALPHA, StepCost


def test_no_limit_until_both_costs_are_measured() -> None:
    cost = StepCost(stall_factor=2.0, floor_s=0.0)
    assert cost.prefill_budget(8, 2048) == 2048
    cost.observe(8, 0, 0.1)  # a decode-only step
    assert cost.prefill_budget(8, 2048) == 2048  # no prefill token timed yet
    cost.observe(8, 100, 0.2)  # 0.1 s over the decode step for 100 tokens: 1 ms a token
    assert cost.token_s == pytest.approx(0.001)
    # target 2 x 0.1 s: 0.1 s left for prefill -> 100 tokens
    assert cost.prefill_budget(8, 2048) == 100


def test_nobody_decoding_means_no_limit() -> None:
    cost = StepCost(stall_factor=2.0, floor_s=0.0, decode_s=0.1, token_s=0.001)
    assert cost.prefill_budget(0, 4096) == 4096


def test_the_floor_and_the_minimum_chunk() -> None:
    cost = StepCost(stall_factor=2.0, floor_s=0.05, decode_s=0.001, token_s=0.0001)
    assert cost.prefill_budget(4, 4096) == int((0.05 - 0.001) / 0.0001)  # the floor, not 2 ms
    slow = StepCost(stall_factor=1.0, floor_s=0.0, decode_s=0.1, token_s=0.01, min_tokens=16)
    assert slow.prefill_budget(4, 4096) == 16  # no time left: still 16 tokens a step
    assert slow.prefill_budget(4, 5) == 5  # never over the budget left


def test_averages_follow_the_newest_steps() -> None:
    cost = StepCost(stall_factor=2.0, floor_s=0.0)
    cost.observe(4, 0, 0.1)
    cost.observe(4, 0, 0.2)
    assert cost.decode_s == pytest.approx((1 - ALPHA) * 0.1 + ALPHA * 0.2)
    cost.observe(0, 50, 0.05)  # a prefill-only step: all its time is the tokens'
    assert cost.token_s == pytest.approx(0.001)
    cost.observe(0, 0, 9.0)  # an empty step teaches nothing
    assert cost.decode_s == pytest.approx((1 - ALPHA) * 0.1 + ALPHA * 0.2)
