"""One shared pool of equal KV blocks for every KV group: the layout and the allocator.

The per-group pools of ``kv_pool`` split a byte budget ahead of time, so one kind can run out
while the other sits idle (the chat overload test: the SWA pool at 87% while the full pool was at
5%). Here every group takes its pages from one free list of blocks of equal bytes. This module
plans the blocks and allocates them; ``PagedKVCache`` builds the slot tensors and the layers' views
on them, and ``page_map.BlockPageMap`` maps a group's tables to the views.

Layout. A block is ``num_slots`` slots; slot ``t`` of every block lives in slot tensor ``t``
(``[num_blocks, slot_elems]`` for K, another for V), and a slot holds the largest layer's page.
A smaller layer packs ``scale`` of its pages into one slot and sees its slot tensor as
``[num_blocks * scale, page, H, D]``: contiguous, so the attention kernels address it as they
address a per-layer tensor today, with physical page ``block * scale + offset``::

    MiMo (full layers: 4 KV heads, SWA layers: 8; 9 full, 39 SWA + 1 MTP)
    slot = one SWA layer's page; a full layer's page is half a slot (scale 2)
    num_slots = 5 (the full group's 9 half-slots, rounded up: the smallest group in one block)
    full page  -> 1 block:  slots 0..4 hold layers f0 f1 | f2 f3 | ... | f8 (half of slot 4 unused)
    SWA page   -> 8 blocks: block j holds SWA layers 5j .. 5j+4 (sub-block j)

    Qwen2.5-VL (28 equal layers): num_slots = 28, one block per page, scale 1: the per-layer
    tensors of today, to the byte.

A group's page is named by its first block; the blocks of its other sub-blocks are kept in a map
(``GroupBlocks.blocks_of``), so the KV manager, the radix tree, the KV events, the P/D payload and
the tiers keep one page id per group and logical page.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from llm_core.caches.kv_groups import KVGroup
from llm_core.caches.page_pool import PagePool


@dataclass(frozen=True)
class LayerSlot:
    """Where one layer's pages live: slot tensor ``tensor`` of sub-block ``sub_block`` of its
    group's page, as page ``offset`` of ``scale`` pages per slot."""

    group: int  # index in the planned groups
    sub_block: int  # which of the group's blocks of a page holds this layer
    tensor: int  # slot tensor index, < num_slots
    scale: int  # this layer's pages per slot
    offset: int  # which of them, < scale


@dataclass(frozen=True)
class BlockLayout:
    """The shape of a shared block pool for a model's KV groups (``plan_block_layout``)."""

    page_size: int
    num_slots: int  # slots (slot tensors) per block
    slot_k_elems: int  # elements of one K slot: the largest layer's K page
    slot_v_elems: int
    blocks_per_page: tuple[int, ...]  # per group: blocks one of its pages takes
    layers: tuple[LayerSlot, ...]  # per model layer

    def block_bytes(self, dtype_bytes: int) -> int:
        return self.num_slots * (self.slot_k_elems + self.slot_v_elems) * dtype_bytes

    def num_blocks(self, budget_bytes: int, dtype_bytes: int) -> int:
        """Whole blocks in ``budget_bytes``."""
        return budget_bytes // self.block_bytes(dtype_bytes)

    def physical_page(self, layer: int, blocks: np.ndarray) -> np.ndarray:
        """Layer ``layer``'s page index in its slot tensor's view for its sub-block's ``blocks``
        (int [...]; negative entries, absent pages, stay negative)."""
        slot = self.layers[layer]
        out = blocks.astype(np.int64) * slot.scale + slot.offset
        return np.where(blocks < 0, -1, out)


class LayoutError(ValueError):
    """The groups' KV shapes do not pack into equal slots."""


def plan_block_layout(groups: Sequence[KVGroup], page_size: int) -> BlockLayout:
    """The blocks for ``groups``: a slot is the largest layer page (K and V alike); a layer whose
    page does not divide it evenly has no place in a shared pool (``LayoutError``)."""
    if not groups:
        raise LayoutError("no KV groups")
    k_page = {g.group_id: page_size * g.spec.kv_heads * g.spec.head_dim for g in groups}
    v_page = {g.group_id: page_size * g.spec.kv_heads * g.spec.v_head_dim for g in groups}
    slot_k, slot_v = max(k_page.values()), max(v_page.values())
    scales: dict[int, int] = {}
    for g in groups:
        k, v = k_page[g.group_id], v_page[g.group_id]
        if k == 0 or slot_k % k or slot_v % v or slot_k // k != slot_v // v:
            raise LayoutError(
                f"KV group {g.group_id}'s page ({k} + {v} elements) does not pack evenly into a slot of"
                f" {slot_k} + {slot_v}"
            )
        scales[g.group_id] = slot_k // k
    # the smallest group fits one block: its pages waste at most part of one slot
    num_slots = min(math.ceil(g.num_layers / scales[g.group_id]) for g in groups)
    per_block = {g.group_id: num_slots * scales[g.group_id] for g in groups}  # layers a block holds
    blocks_per_page = tuple(math.ceil(g.num_layers / per_block[g.group_id]) for g in groups)
    slots: dict[int, LayerSlot] = {}
    for index, g in enumerate(groups):
        s, n = scales[g.group_id], per_block[g.group_id]
        for j, layer in enumerate(g.layers):
            sub, r = divmod(j, n)
            slots[layer] = LayerSlot(index, sub, r // s, s, r % s)
    if sorted(slots) != list(range(len(slots))):
        raise LayoutError("the groups do not cover the layers 0..L-1 exactly once")
    return BlockLayout(
        page_size, num_slots, slot_k, slot_v, blocks_per_page, tuple(slots[i] for i in range(len(slots)))
    )


class GroupBlocks:
    """A group's pages over the shared ``blocks``: ``PagePool``'s interface for a group manager,
    each page ``blocks_per_page`` blocks, named by its first.

    ``num_free`` is what this group could take if it were alone; groups compete for the same
    blocks, so whoever allocates for several groups at once checks ``blocks.num_free`` against
    the sum of ``cost(n)`` (the KV manager does)."""

    def __init__(self, blocks: PagePool, blocks_per_page: int, name: str) -> None:
        assert blocks_per_page >= 1, blocks_per_page
        self.blocks = blocks
        self.name = name
        self.page_size = blocks.page_size
        self.blocks_per_page = blocks_per_page
        self.num_pages = blocks.num_pages // blocks_per_page  # alone, at most
        # page (its first block) -> every block of the page, sub-block order; -1: not a page here.
        # One row more than there are blocks, always -1: a table's NOT_RESIDENT (-1) entry
        # gathers -1 from it, so page maps need no mask.
        self.blocks_of = np.full((blocks.num_pages + 1, blocks_per_page), -1, dtype=np.int32)
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return self.blocks.num_free // self.blocks_per_page

    @property
    def num_used(self) -> int:
        return len(self._used)

    def cost(self, n: int) -> int:
        """Blocks ``n`` pages of this group take."""
        return n * self.blocks_per_page

    def can_alloc(self, n: int) -> bool:
        return self.cost(n) <= self.blocks.num_free

    def alloc(self, n: int) -> list[int] | None:
        """``n`` pages (their first blocks), or None (nothing taken) when the blocks are short."""
        got = self.blocks.alloc(self.cost(n))
        if got is None:
            return None
        k = self.blocks_per_page
        pages = got[::k]
        for i, page in enumerate(pages):
            self.blocks_of[page] = got[i * k : (i + 1) * k]
        self._used.update(pages)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages (each in use by this group; ``-1`` entries are skipped)."""
        back: list[int] = []
        for page in pages:
            if page < 0:
                continue
            if page not in self._used:
                raise AssertionError(f"{self.name}: double free of page {page}")
            self._used.discard(page)
            back.extend(int(b) for b in self.blocks_of[page])
            self.blocks_of[page] = -1
        self.blocks.free(back)

    def is_used(self, page: int) -> bool:
        return page in self._used

    def used_pages(self) -> set[int]:
        return set(self._used)

    def held_blocks(self) -> list[int]:
        """Every block its pages take (each page's ``blocks_per_page``)."""
        return [int(b) for page in self._used for b in self.blocks_of[page]]

    def sub_block_table(self, table: np.ndarray, sub_block: int) -> np.ndarray:
        """The blocks of sub-block ``sub_block`` for a table of this group's pages (int32 [...],
        negative entries stay -1): what a layer of that sub-block reads."""
        if sub_block == 0:
            return table
        return np.where(table < 0, -1, self.blocks_of[np.maximum(table, 0), sub_block]).astype(np.int32)

    def check_integrity(self) -> None:
        """Each page's blocks are in use and no block belongs to two pages of this group."""
        seen: set[int] = set()
        for page in self._used:
            row = [int(b) for b in self.blocks_of[page]]
            if row[0] != page or any(b < 0 or not self.blocks.is_used(b) for b in row) or seen & set(row):
                raise AssertionError(f"{self.name}: page {page} has blocks {row}")
            seen.update(row)
