"""The page map: a batch's group tables become one table and one slot list per layer view, each
entry the layer's physical page of the group's page (``physical``); absent pages stay absent."""

from __future__ import annotations

import torch

from llm_core.caches.kv_pool import KVLayout, PagedKVCache
from llm_core.caches.page_map import GroupPageMap
from llm_core.caches.seq_kv import NOT_RESIDENT

PAGE = 4


def shared_cache() -> PagedKVCache:
    # layers 0 and 3 full (2 KV heads), the other 5 a window (4 heads): a full page is 1 block
    # (both full layers share the block's one slot), a window page 5 blocks
    layout = KVLayout.hybrid(
        (None, 6, 6, None, 6, 6, 6), full_kv_heads=2, window_kv_heads=4, head_dim=8, v_head_dim=8
    )
    return PagedKVCache(layout, PAGE, num_blocks=40)


def test_each_view_reads_its_layers_physical_pages() -> None:
    kv = shared_cache()
    assert kv.block_layout is not None and kv.block_layout.blocks_per_page == (1, 5)
    full, swa = kv.pools[0].alloc(3), kv.pools[1].alloc(3)
    assert full is not None and swa is not None
    rows = [full, [NOT_RESIDENT, swa[1], swa[2]]]  # the window's first page dropped
    tables = tuple(torch.tensor([row], dtype=torch.int32) for row in rows)
    positions = torch.tensor([9, 10, 11], dtype=torch.int64)  # on logical page 2
    slots = tuple(
        torch.tensor(row, dtype=torch.int64)[positions // PAGE] * PAGE + positions % PAGE for row in rows
    )
    view_tables, view_slots = kv.page_map.view_tables(tables, slots, PAGE)
    assert len(view_tables) == len(view_slots) == 2 + 5  # full offsets 0 and 1, five SWA sub-blocks
    for layer in range(kv.num_layers):
        v = kv.layer(layer).group
        assert v == kv.page_map.layer_view[layer]
        physical = kv.physical(layer, rows[kv.layer_group[layer]])
        assert view_tables[v][0].tolist() == physical
        assert view_slots[v].tolist() == [physical[2] * PAGE + p % PAGE for p in (9, 10, 11)]
        assert physical[1] >= 0 and (physical[0] == NOT_RESIDENT) == (kv.layer_group[layer] == 1)
        assert max(physical) < kv.layer(layer).k.shape[0]
    # the two full layers read the two halves of one slot; no two SWA layers read one block
    assert kv.physical(0, full) == [2 * p for p in full] and kv.physical(3, full) == [2 * p + 1 for p in full]
    swa_blocks = [b for layer in (1, 2, 4, 5, 6) for b in kv.physical(layer, swa)]
    assert len(set(swa_blocks)) == 15 and not set(swa_blocks) & set(full)


def test_a_pool_per_group_maps_nothing() -> None:
    m = GroupPageMap((0, 1, 1, 0))
    tables = (torch.tensor([[3, 4]], dtype=torch.int32), torch.tensor([[-1, 2]], dtype=torch.int32))
    slots = (torch.tensor([17]), torch.tensor([9]))
    got = m.view_tables(tables, slots, PAGE)
    assert got[0] is tables and got[1] is slots
    assert m.physical(2, [-1, 2]) == [-1, 2]


def test_a_full_attention_model_keeps_its_tables() -> None:
    layout = KVLayout.hybrid((None,) * 4, full_kv_heads=2, window_kv_heads=2, head_dim=8, v_head_dim=8)
    kv = PagedKVCache(layout, PAGE, num_blocks=8)
    assert kv.page_map.layer_view == (0, 0, 0, 0)
    table, slot = torch.tensor([[5, 1]], dtype=torch.int32), torch.tensor([6])
    tables, slots = kv.page_map.view_tables((table,), (slot,), PAGE)
    assert tables[0] is table and slots[0] is slot
    assert kv.physical(3, [5, 1]) == [5, 1] and kv.layer(3).k.shape == (8, PAGE, 2, 8)
