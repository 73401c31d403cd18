"""From a KV group's page ids to where each layer's KV lives: the layers' views of the storage.

The KV manager, the radix tree, the KV events, the P/D payload and the tiers name one page id per
KV group and logical page. The kernels read a layer through a page table and write slots in that
layer's tensor. Between the two sits a *page map*:

    GroupPageMap   a pool and tensors per group: a layer's page is its group's page id (identity),
                   one view per group
    BlockPageMap   one shared block pool (``kv_blocks``): a layer's page is
                   ``blocks_of[page, sub_block] * scale + offset`` in its slot tensor's view, one
                   view per distinct (group, sub_block, scale, offset)

A view is a set of layers that read the same physical pages; the attention batch carries one page
table and one slot list per view (``view_tables``), and ``LayerKV.group`` is the layer's view.
Page reads outside the kernels (the host tier, a restore, the P/D payload) map a group's page row
to a layer's physical pages through ``physical``.

Imports: numpy, torch and ``kv_blocks`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from llm_core.caches.kv_blocks import BlockLayout, GroupBlocks

Tables = tuple[tuple[Tensor, ...], tuple[Tensor, ...]]  # (page tables int32 [B, P], slots int64 [T])


class PageMap(Protocol):
    """Group page ids -> each layer's physical pages."""

    # layer -> its view: which of ``view_tables``' tables and slots the layer reads
    layer_view: tuple[int, ...]

    def view_tables(self, tables: tuple[Tensor, ...], slots: tuple[Tensor, ...], page_size: int) -> Tables:
        """One page table and one slot list per view, from one per group (CPU tensors)."""
        ...

    def physical(self, layer: int, pages: Sequence[int]) -> list[int]:
        """Layer ``layer``'s physical pages for its group's ``pages`` (negative entries stay -1)."""
        ...


class GroupPageMap:
    """A pool and per-layer tensors per group: the views are the groups, the map the identity."""

    def __init__(self, layer_group: tuple[int, ...]) -> None:
        self.layer_view = layer_group

    def view_tables(self, tables: tuple[Tensor, ...], slots: tuple[Tensor, ...], page_size: int) -> Tables:
        return tables, slots

    def physical(self, layer: int, pages: Sequence[int]) -> list[int]:
        return list(pages)


class BlockPageMap:
    """One shared block pool: a view per (group, sub-block, scale, offset) of ``layout``'s layers.

    ``pools[g]``: group g's allocator (its ``blocks_of`` names the blocks of each page's
    sub-blocks). For a model whose layouts are trivial (one group, one block per page, scale 1:
    any full-attention model) the only view is the group's and its tables pass through as they are.
    """

    def __init__(self, layout: BlockLayout, pools: Sequence[GroupBlocks]) -> None:
        self.layout = layout
        self.pools = tuple(pools)
        keys = [(s.group, s.sub_block, s.scale, s.offset) for s in layout.layers]
        # views in the order their first layer appears: group 0's first, like the group tables
        self.views: tuple[tuple[int, int, int, int], ...] = tuple(dict.fromkeys(keys))
        index = {key: i for i, key in enumerate(self.views)}
        self.layer_view = tuple(index[key] for key in keys)

    def view_tables(self, tables: tuple[Tensor, ...], slots: tuple[Tensor, ...], page_size: int) -> Tables:
        out_tables: list[Tensor] = []
        out_slots: list[Tensor] = []
        # per group, made on first use: its table (int32 [B, P], NOT_RESIDENT (-1) where absent)
        # and its slots' page and offset in the page (int64 [T] each; a write slot is resident)
        split: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for group, sub, scale, offset in self.views:
            if sub == 0 and scale == 1 and offset == 0:
                out_tables.append(tables[group])  # the group's own pages: nothing to map
                out_slots.append(slots[group])
                continue
            if group not in split:
                split[group] = (tables[group].numpy(), *np.divmod(slots[group].numpy(), page_size))
            t, page, within = split[group]
            if sub:  # the sub-block's blocks; blocks_of's last row (-1) answers the -1 entries
                blocks_of = self.pools[group].blocks_of  # int32 [N + 1, k]
                t, page = blocks_of[t, sub], blocks_of[page, sub]
            if scale != 1 or offset:
                # -1 becomes offset - scale, in [-scale, -1]: clamped back to -1
                t = np.maximum(t * scale + offset, -1)
                page = page * scale + offset
            out_tables.append(torch.from_numpy(np.ascontiguousarray(t, dtype=np.int32)))
            out_slots.append(torch.from_numpy(page.astype(np.int64) * page_size + within))
        return tuple(out_tables), tuple(out_slots)

    def physical(self, layer: int, pages: Sequence[int]) -> list[int]:
        slot = self.layout.layers[layer]
        arr = np.asarray(pages, dtype=np.int64)  # -1 (NOT_RESIDENT) where absent
        if slot.sub_block:  # blocks_of's last row (-1) answers the -1 entries
            arr = self.pools[slot.group].blocks_of[arr, slot.sub_block].astype(np.int64)
        return np.maximum(arr * slot.scale + slot.offset, -1).tolist()
