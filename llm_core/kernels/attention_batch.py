"""AttentionBatch: where each new token's KV goes and which pages each sequence reads, for one step.

The model runner builds one per forward step; every attention layer consumes it. The batch packs the
new tokens of B sequences back to back into T rows (varlen, no padding):

    packed tokens  [ seq0 new | seq1 new | ... ]        cu_seqlens_q = [0, n0, n0+n1, ...]
    seq b          [ cached (seq_lens[b] - n_b) | new n_b ]   positions of the new tokens:
                                                              seq_lens[b] - n_b .. seq_lens[b] - 1

Pages: logical page i of a sequence holds positions [i * page_size, (i + 1) * page_size). Both
page tables use this logical indexing. The full table maps every logical page < ceil(seq_len /
page_size). The SWA table marks pages that slid out of every query's window with -1:

    positions   0        16       32       48       64   (page_size 16, W = 20, queries at 60..63)
    logical     | page 0 | page 1 | page 2 | page 3 |
    swa table      -1       -1       p7       p2        keys needed: 41..63 -> pages 2..3 only

A KV "slot" is ``physical_page * page_size + offset`` into the pool viewed as
[num_pages * page_size, Hkv, D]. This module knows nothing about models or the scheduler.
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
    full_page_table: Tensor  # int32 [B, P] logical page i -> physical page in the full pool
    swa_page_table: Tensor  # int32 [B, P] logical page i -> physical page in the SWA pool, -1 = absent
    full_slots: Tensor  # int64 [T] flat slot (page * page_size + offset) of each new token's full KV
    swa_slots: Tensor  # int64 [T] same for the SWA pool
    max_seqlen_q: int

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.full_slots.shape[0])

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
    def is_swa(self) -> bool: ...


class PagedKV(Protocol):
    """What the model needs from the KV cache (``llm_core.caches.kv_pool.DualKVCache`` provides it)."""

    def layer(self, i: int) -> LayerKVLike: ...


def slots_for(page_table_row: Tensor, positions: Tensor, page_size: int) -> Tensor:
    """int64 slots of ``positions`` [n] for one sequence's page-table row [P]; pages must be mapped."""
    pages = page_table_row.to(torch.int64)[positions // page_size]
    assert bool((pages >= 0).all()), "a new token's page is not mapped in the page table"
    return pages * page_size + positions % page_size


def build_attention_batch(
    seq_lens: Sequence[int],
    num_new_tokens: Sequence[int],
    full_pages: Sequence[Sequence[int]],
    swa_pages: Sequence[Sequence[int | None]],
    page_size: int,
    device: torch.device | str = "cpu",
) -> AttentionBatch:
    """Build the batch from per-sequence page lists (the model runner's job in one place).

    ``seq_lens[b]`` counts tokens after this step; the new tokens are the last ``num_new_tokens[b]``.
    ``swa_pages[b][i]`` is None (or -1) for logical pages that left the window. Tables are padded to
    the longest list with -1.
    """
    num = len(seq_lens)
    assert num == len(num_new_tokens) == len(full_pages) == len(swa_pages)
    width = max([1, *(len(p) for p in full_pages), *(len(p) for p in swa_pages)])
    full_table = torch.full((num, width), -1, dtype=torch.int32)
    swa_table = torch.full((num, width), -1, dtype=torch.int32)
    for b in range(num):
        if full_pages[b]:
            full_table[b, : len(full_pages[b])] = torch.tensor(list(full_pages[b]), dtype=torch.int32)
        row = [-1 if p is None else p for p in swa_pages[b]]
        if row:
            swa_table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
    full_slots, swa_slots = [], []
    for b in range(num):
        n, total = num_new_tokens[b], seq_lens[b]
        assert 0 < n <= total, f"sequence {b}: {n} new tokens of {total}"
        pos = torch.arange(total - n, total, dtype=torch.int64)
        full_slots.append(slots_for(full_table[b], pos, page_size))
        swa_slots.append(slots_for(swa_table[b], pos, page_size))
    cu = torch.zeros(num + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(list(num_new_tokens), dtype=torch.int32), 0)
    return AttentionBatch(
        cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        full_page_table=full_table.to(device),
        swa_page_table=swa_table.to(device),
        full_slots=torch.cat(full_slots).to(device),
        swa_slots=torch.cat(swa_slots).to(device),
        max_seqlen_q=max(num_new_tokens),
    )
