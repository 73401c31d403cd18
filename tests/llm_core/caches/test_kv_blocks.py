"""The shared block pool: its layout for real model shapes, that no two layers' pages overlap in
the slot tensors, and the per-group allocator over one free list."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from llm_core.caches.kv_blocks import GroupBlocks, LayoutError, plan_block_layout
from llm_core.caches.kv_groups import KVGroup, KVGroupSpec, kv_groups
from llm_core.caches.page_pool import PagePool


def groups_of(kinds: list[int | None], heads: dict[int | None, int], dk: int, dv: int) -> tuple[KVGroup, ...]:
    """Layer i: full attention (None) or window w, with ``heads[kind]`` KV heads."""
    return kv_groups(
        [
            KVGroupSpec("full_attention" if w is None else "sliding_window", heads[w], dk, dv, 2, w)
            for w in kinds
        ]
    )


def mimo_groups() -> tuple[KVGroup, ...]:
    # MiMo-V2-Flash's plan: 48 layers, full iff i == 0 or (i + 1) % 6 == 0 (9 full), one MTP layer
    kinds: list[int | None] = [None if i == 0 or (i + 1) % 6 == 0 else 128 for i in range(48)] + [128]
    return groups_of(kinds, {None: 4, 128: 8}, 192, 128)


def test_mimo_packs_two_full_layers_a_slot_and_cuts_the_window_group_in_eight() -> None:
    layout = plan_block_layout(mimo_groups(), 16)
    assert layout.num_slots == 5 and layout.blocks_per_page == (1, 8)
    assert layout.slot_k_elems == 16 * 8 * 192 and layout.slot_v_elems == 16 * 8 * 128
    full = [s for s in layout.layers if s.group == 0]
    assert len(full) == 9 and all(s.scale == 2 and s.sub_block == 0 for s in full)
    assert [(s.tensor, s.offset) for s in full] == [(j // 2, j % 2) for j in range(9)]
    window = [s for s in layout.layers if s.group == 1]
    assert [s.sub_block for s in window] == [j // 5 for j in range(40)]
    assert [s.tensor for s in window] == [j % 5 for j in range(40)] and {s.scale for s in window} == {1}
    # what a page costs: a full page 5 slots (4.5 used), an SWA page 40 slots (all used)
    assert layout.block_bytes(2) == 5 * 16 * 8 * (192 + 128) * 2


def test_a_full_attention_model_keeps_todays_tensors() -> None:
    layout = plan_block_layout(groups_of([None] * 28, {None: 4}, 128, 128), 16)
    assert layout.num_slots == 28 and layout.blocks_per_page == (1,)
    assert [(s.tensor, s.scale, s.offset, s.sub_block) for s in layout.layers] == [
        (i, 1, 0, 0) for i in range(28)
    ]


def test_uneven_heads_do_not_pack() -> None:
    with pytest.raises(LayoutError, match="does not pack"):
        plan_block_layout(groups_of([None, 8, 8], {None: 3, 8: 2}, 16, 16), 4)


def test_every_layer_page_has_its_own_memory() -> None:
    # 3 full layers (2 heads) and 7 window layers (4 heads): num_slots 2, the window cut in 4
    page, dk, dv = 2, 3, 2
    kinds: list[int | None] = [None, 5, 5, None, 5, 5, 5, None, 5, 5]
    groups = groups_of(kinds, {None: 2, 5: 4}, dk, dv)
    layout = plan_block_layout(groups, page)
    assert layout.num_slots == 2 and layout.blocks_per_page == (1, 4)
    blocks = PagePool(40, page, "blocks")
    pools = [GroupBlocks(blocks, k, f"g{i}") for i, k in enumerate(layout.blocks_per_page)]
    k_slots = torch.zeros(layout.num_slots, blocks.num_pages, layout.slot_k_elems)

    def view(layer: int) -> torch.Tensor:  # the layer's K pages, as the kernels see them
        slot = layout.layers[layer]
        heads = groups[slot.group].spec.kv_heads
        return k_slots[slot.tensor].view(blocks.num_pages * slot.scale, page, heads, dk)

    rng = random.Random(0)
    pages: list[tuple[int, int]] = []  # (group, page)
    while True:
        g = rng.randrange(2)
        got = pools[g].alloc(1)
        if got is None:
            break
        pages.append((g, got[0]))
    assert blocks.num_free < max(layout.blocks_per_page)  # the pool was filled by both groups
    assert {g for g, _ in pages} == {0, 1}
    stamp = 0.0
    want: dict[tuple[int, int], float] = {}
    for g, p in pages:
        for layer in groups[g].layers:
            slot = layout.layers[layer]
            block = pools[g].sub_block_table(np.array([p], dtype=np.int32), slot.sub_block)
            phys = int(layout.physical_page(layer, block)[0])
            stamp += 1.0
            view(layer)[phys].fill_(stamp)
            want[(layer, p)] = stamp
    for (layer, p), value in want.items():  # nothing written later landed on an earlier page
        g = layout.layers[layer].group
        block = pools[g].sub_block_table(np.array([p], dtype=np.int32), layout.layers[layer].sub_block)
        phys = int(layout.physical_page(layer, block)[0])
        assert bool((view(layer)[phys] == value).all()), (layer, p)
    for pool in pools:
        pool.check_integrity()


def test_groups_share_one_free_list() -> None:
    blocks = PagePool(16, 4, "blocks")
    full, window = GroupBlocks(blocks, 1, "full"), GroupBlocks(blocks, 4, "swa")
    a = window.alloc(3)  # 12 blocks
    assert a is not None and window.num_used == 3 and blocks.num_free == 4
    assert full.num_free == 4 and window.num_free == 1 and not window.can_alloc(2)
    b = full.alloc(4)
    assert b is not None and window.alloc(1) is None and blocks.num_free == 0  # nothing taken
    table = np.array([[a[0], -1, a[2]]], dtype=np.int32)
    assert window.sub_block_table(table, 0) is table
    third = window.sub_block_table(table, 3)
    assert third[0, 1] == -1 and third[0, 0] == window.blocks_of[a[0], 3]
    window.free([a[1], -1])
    assert blocks.num_free == 4 and full.alloc(4) is not None
    with pytest.raises(AssertionError, match="double free"):
        window.free([a[1]])
    full.check_integrity()
    window.check_integrity()
    blocks.check_integrity()
