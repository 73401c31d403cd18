"""The choice itself: Dynamo's cost, SGLang's guard (both margins), random ties, the config checks."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from epd.llm_routing.policy import (
    Candidate,
    RouterConfig,
    affinity_cost,
    balanced,
    choose_affinity,
    choose_least_load,
)


def test_cost_is_dynamos_worked_example() -> None:
    # (prefill, decode) blocks (8, 10), (5, 5), (2, 9): costs 18, 10, 11; the second wins although
    # the third has the most cache. Here the prefill term already holds the uncached prompt.
    cfg = RouterConfig(balance_abs_tokens=1000)
    cands = [Candidate(0, 0, 8, 10, 10), Candidate(1, 0, 5, 5, 5), Candidate(2, 0, 2, 9, 9)]
    assert [affinity_cost(c, 0, cfg) for c in cands] == [18, 10, 11]
    assert choose_affinity(cands, 0, cfg, random.Random(0)).slot == 1


def test_weights_scale_the_two_terms() -> None:
    c = Candidate(0, hit_tokens=30, prefill_tokens=5, decode_tokens=7, held_tokens=7)
    assert affinity_cost(c, 100, RouterConfig(prefill_weight=2.0, decode_weight=0.5)) == 2 * 75 + 3.5


def test_the_guard_needs_both_margins() -> None:
    cfg = RouterConfig(balance_abs_tokens=100, balance_rel=1.5)
    light = Candidate(0, 0, 0, 1000, 1000)
    rel_fails = Candidate(1, 0, 0, 1101, 1101)
    assert balanced([light, rel_fails], cfg) == [light, rel_fails]
    assert balanced([light, Candidate(1, 0, 0, 1501, 1501)], cfg) == [light]  # both exceeded
    small = Candidate(0, 0, 0, 10, 10)
    assert len(balanced([small, Candidate(1, 0, 0, 90, 90)], cfg)) == 2  # abs fails (9x the load)


def test_the_guard_overrides_a_large_hit_on_a_hot_engine() -> None:
    hot = Candidate(0, hit_tokens=9000, prefill_tokens=0, decode_tokens=6000, held_tokens=6000)
    cold = Candidate(1, hit_tokens=0, prefill_tokens=0, decode_tokens=0, held_tokens=0)
    rng = random.Random(0)
    assert choose_affinity([hot, cold], 10_000, RouterConfig(balance_abs_tokens=10**9), rng).slot == 0
    assert choose_affinity([hot, cold], 10_000, RouterConfig(balance_abs_tokens=4096), rng).slot == 1


def test_the_guard_counts_what_waiting_requests_hold() -> None:
    """Five mostly cached prompts waiting on one engine (little to compute, 12,500 tokens held)
    against one long request decoding on another: the cost prefers the busy engine (its cache),
    the guard drops it."""
    busy = Candidate(0, hit_tokens=2400, prefill_tokens=500, decode_tokens=0, held_tokens=12_500)
    one = Candidate(1, hit_tokens=600, prefill_tokens=0, decode_tokens=2500, held_tokens=2500)
    assert busy.load < one.load  # what least-load sees: the busy engine looks lighter
    cfg = RouterConfig()
    assert balanced([busy, one], cfg) == [one]
    assert (
        choose_affinity([busy, one], 2500, RouterConfig(balance_abs_tokens=10**9), random.Random(0)).slot == 0
    )
    assert choose_affinity([busy, one], 2500, cfg, random.Random(0)).slot == 1


def test_ties_break_at_random() -> None:
    rng = random.Random(0)
    cands = [Candidate(i, 0, 0, 0, 0) for i in range(4)]
    picks = Counter(choose_affinity(cands, 10, RouterConfig(), rng).slot for _ in range(400))
    assert set(picks) == {0, 1, 2, 3} and min(picks.values()) > 60
    picks = Counter(choose_least_load(cands, rng).slot for _ in range(400))
    assert set(picks) == {0, 1, 2, 3} and min(picks.values()) > 60


def test_least_load_ignores_the_cache() -> None:
    cands = [Candidate(0, 10_000, 0, 50, 50), Candidate(1, 0, 10, 20, 20)]
    assert choose_least_load(cands, random.Random(0)).slot == 1


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"policy": "fastest"}, "policy"),
        ({"prefill_weight": -1.0}, "prefill_weight"),
        ({"balance_rel": 0.5}, "balance_rel"),
        ({"approx_ttl_s": 0.0}, "approx_ttl_s"),
        ({"default_page_size": 0}, "default_page_size"),
    ],
)
def test_config_checks_name_the_field(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RouterConfig(**kw)  # type: ignore[arg-type]
