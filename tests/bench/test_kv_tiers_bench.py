"""bench.kv_tiers on a short history: the tiered engine really copies the history back (restored
tokens), and both engines give the same greedy ids (the figures themselves are not asserted)."""

from __future__ import annotations

from bench.kv_tiers import run_length


def test_a_short_run_restores_the_history_and_agrees_with_recompute() -> None:
    row = run_length(512, 1, 0)
    assert row["identical"] is True
    assert row["restored_tokens"] >= 512 - 16  # the whole history but its last partial page
    assert row["tiny_bytes_swa_aware"] < row["tiny_bytes_all_layers"]
