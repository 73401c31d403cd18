"""The layer plan per KV group: every page of a full-attention group, the last window's pages of a
sliding-window group; a full-attention model's plan moves every page of every layer."""

from __future__ import annotations

from llm_core.caches.kv_pool import KVLayout
from llm_core.kv_transfer.layer_plan import LayerPlan


def test_full_attention_model_moves_every_page() -> None:
    layout = KVLayout.hybrid((None,) * 3, full_kv_heads=2, window_kv_heads=2, head_dim=8, v_head_dim=8)
    plan = LayerPlan(layout, 4, 22)
    assert len(plan.groups) == 1
    assert all(plan.pages_of(i) == range(0, 6) for i in range(3))
    assert plan.nbytes == plan.all_layers_nbytes == 3 * 6 * 4 * 2 * 16 * 2


def test_window_group_moves_its_last_window() -> None:
    layout = KVLayout.hybrid((None, 6, 6), full_kv_heads=2, window_kv_heads=4, head_dim=8, v_head_dim=6)
    plan = LayerPlan(layout, 4, 22)  # b = 20: the window [15, 20) starts on page 3
    assert [g.spec.kind for g in plan.groups] == ["full_attention", "sliding_window"]
    assert plan.pages_of(0) == range(0, 6) and plan.pages_of(1) == plan.pages_of(2) == range(3, 6)
    assert plan.heads_of(0) == 2 and plan.heads_of(1) == 4
    assert plan.page_bytes(1) == 4 * 4 * (8 + 6) * 2
