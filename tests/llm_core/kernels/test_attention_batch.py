"""AttentionBatch construction: positions, slots and padded page tables from per-sequence pages."""

from __future__ import annotations

import pytest
import torch

from llm_core.kernels.attention_batch import build_attention_batch


def test_positions_slots_and_tables() -> None:
    page = 4
    # seq0: 6 cached + 3 new (positions 6..8); seq1: 2 new from scratch; seq2: decode at position 9
    batch = build_attention_batch(
        seq_lens=[9, 2, 10],
        num_new_tokens=[3, 2, 1],
        group_pages=[[[7, 2, 5], [0], [1, 3, 4]], [[None, 6, 8], [9], [None, None, 10]]],
        page_size=page,
    )
    assert batch.cu_seqlens_q.tolist() == [0, 3, 5, 6]
    assert batch.max_seqlen_q == 3 and batch.num_seqs == 3 and batch.num_tokens == 6
    assert batch.positions().tolist() == [6, 7, 8, 0, 1, 9]
    # position p of a sequence lives at table[p // page] * page + p % page
    assert batch.slots[0].tolist() == [2 * 4 + 2, 2 * 4 + 3, 5 * 4 + 0, 0, 1, 4 * 4 + 1]
    assert batch.slots[1].tolist() == [6 * 4 + 2, 6 * 4 + 3, 8 * 4 + 0, 9 * 4, 9 * 4 + 1, 10 * 4 + 1]
    assert batch.page_tables[0].shape == (3, 3) and batch.page_tables[0][1].tolist() == [0, -1, -1]
    assert batch.page_tables[1][2].tolist() == [-1, -1, 10]
    assert batch.cu_seqlens_q.dtype == batch.seq_lens.dtype == torch.int32
    assert batch.slots[0].dtype == torch.int64


def test_new_token_on_unmapped_page_is_an_invariant_violation() -> None:
    with pytest.raises(AssertionError, match="not mapped"):
        build_attention_batch([5], [1], [[[0, 1]], [[3, None]]], page_size=4)
