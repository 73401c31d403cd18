"""bench.mtp on a short run: every k runs on the same prompts, gives k = 0's greedy ids, and the
distilled heads are accepted (the speed figures themselves are not asserted)."""

from __future__ import annotations

from bench.mtp import run


def test_a_short_run_agrees_with_k0_and_accepts_drafts() -> None:
    rows = run([0, 2], [1, 3], max_tokens=12, seed=7, repeats=2)
    assert [(r["k"], r["batch"]) for r in rows] == [(0, 1), (0, 3), (2, 1), (2, 3)]
    assert all(r["weight_mib_per_token"] > 0 for r in rows)
    assert all(r["identical"] for r in rows)
    assert all(len(r["tokens_per_s_repeats"]) == 2 for r in rows)
    spec = [r for r in rows if r["k"] == 2]
    # random heads accept nothing (1.0); over 8 requests the distilled ones are accepted (1.5 here)
    assert all(r["acceptance_length"] > 1.2 for r in spec), spec
    assert all(0.0 < r["draft_acceptance_rate"] <= 1.0 for r in spec)
