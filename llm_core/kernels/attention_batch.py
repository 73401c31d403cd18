"""AttentionBatch: where each new token's KV goes and which pages each sequence reads, for one step.

The model runner builds one per forward step; every attention layer consumes it. The batch packs the
new tokens of B sequences back to back into T rows (varlen, no padding):

    packed tokens  [ seq0 new | seq1 new | ... ]        cu_seqlens_q = [0, n0, n0+n1, ...]
    seq b          [ cached (seq_lens[b] - n_b) | new n_b ]   positions of the new tokens:
                                                              seq_lens[b] - n_b .. seq_lens[b] - 1

Pages: logical page i of a sequence holds positions [i * page_size, (i + 1) * page_size). The
batch has one page table per layer view (``llm_core.caches.page_map``: the layers that read the
same physical pages; with a pool per KV group, one per group in the cache's group order); every
table uses this logical indexing. A
full-attention table maps every logical page < ceil(seq_len / page_size). A sliding-window table
marks pages that slid out of every query's window with -1:

    positions   0        16       32       48       64   (page_size 16, W = 20, queries at 60..63)
    logical     | page 0 | page 1 | page 2 | page 3 |
    swa table      -1       -1       p7       p2        keys needed: 41..63 -> pages 2..3 only

A KV "slot" is ``physical_page * page_size + offset`` into a layer's pool viewed as
[num_pages * page_size, Hkv, D]. A layer reads the table and slots of its view
(``LayerKVLike.group``). This module knows nothing about models or the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass
class AttentionBatch:
    """Per-step attention metadata (all tensors on the model's device)."""

    cu_seqlens_q: Tensor  # int32 [B+1] offsets of each sequence's new tokens in the packed [T] batch
    seq_lens: Tensor  # int32 [B]   tokens of each sequence after this step (cached + new)
    # per layer view: int32 [B, P] logical page i -> the view's physical page (-1: absent, a page
    # that left a sliding window)
    page_tables: tuple[Tensor, ...]
    # per layer view: int64 [T] flat slot (page * page_size + offset) of each new token
    slots: tuple[Tensor, ...]
    max_seqlen_q: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slots[0].shape[0])

    def positions(self) -> Tensor:
        """int64 [T]: absolute position of every packed new token."""
        q_lens = self.cu_seqlens_q[1:] - self.cu_seqlens_q[:-1]  # [B]
        starts = (self.seq_lens - q_lens).to(torch.int64)  # [B] first new position
        seq_of_token = torch.repeat_interleave(torch.arange(self.num_seqs, device=q_lens.device), q_lens)
        offset = (
            torch.arange(self.num_tokens, device=q_lens.device)
            - self.cu_seqlens_q[:-1].to(torch.int64)[seq_of_token]
        )
        return starts[seq_of_token] + offset


class LayerKVLike(Protocol):
    """One layer's paged KV tensors: k [N, page, Hkv, D], v [N, page, Hkv, Dv]."""

    @property
    def k(self) -> Tensor: ...
    @property
    def v(self) -> Tensor: ...
    @property
    def window(self) -> int | None: ...  # its group's keys per query; None for full attention
    @property
    def group(self) -> int: ...  # the layer's view: which of the batch's tables and slots it reads


class PagedKV(Protocol):
    """What the model needs from the KV cache (``llm_core.caches.kv_pool.PagedKVCache`` provides it)."""

    def layer(self, i: int) -> LayerKVLike: ...


def slots_for(page_table_row: Tensor, positions: Tensor, page_size: int) -> Tensor:
    """int64 slots of ``positions`` [n] for one sequence's page-table row [P]; pages must be mapped."""
    pages = page_table_row.to(torch.int64)[positions // page_size]
    assert bool((pages >= 0).all()), "a new token's page is not mapped in the page table"
    return pages * page_size + positions % page_size


def build_attention_batch(
    seq_lens: Sequence[int],
    num_new_tokens: Sequence[int],
    group_pages: Sequence[Sequence[Sequence[int | None]]],
    page_size: int,
    device: torch.device | str = "cpu",
) -> AttentionBatch:
    """Build the batch from per-sequence page lists (the model runner's job in one place).

    ``seq_lens[b]`` counts tokens after this step; the new tokens are the last ``num_new_tokens[b]``.
    ``group_pages[g][b]``: sequence b's page list in KV group g, None (or -1) for logical pages
    that left the window. Tables are padded to the longest list with -1.
    """
    num = len(seq_lens)
    assert num == len(num_new_tokens) and all(len(rows) == num for rows in group_pages)
    width = max([1, *(len(p) for rows in group_pages for p in rows)])
    tables = []
    for rows in group_pages:
        table = torch.full((num, width), -1, dtype=torch.int32)
        for b in range(num):
            row = [-1 if p is None else p for p in rows[b]]
            if row:
                table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
        tables.append(table)
    slots: list[list[Tensor]] = [[] for _ in tables]
    for b in range(num):
        n, total = num_new_tokens[b], seq_lens[b]
        assert 0 < n <= total, f"sequence {b}: {n} new tokens of {total}"
        pos = torch.arange(total - n, total, dtype=torch.int64)
        for g, table in enumerate(tables):
            slots[g].append(slots_for(table[b], pos, page_size))
    cu = torch.zeros(num + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(list(num_new_tokens), dtype=torch.int32), 0)
    return AttentionBatch(
        cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        page_tables=tuple(t.to(device) for t in tables),
        slots=tuple(torch.cat(s).to(device) for s in slots),
        max_seqlen_q=max(num_new_tokens),
    )
