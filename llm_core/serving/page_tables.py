"""Page tables from page rows: what a step's attention reads, built by the model runner and the
speculator from the rows the scheduler hands them (``SchedulerOutput.page_rows``, the KV manager's
``rows``).

``token_positions`` places a step's packed new tokens (sequence, position); ``build_page_tables``
turns each sequence's page rows per KV group into int32 [B, P] tables and each new token's write
slot; ``DecodePageTables`` keeps the tables across decode steps and patches only the rows that
changed. The sequences are read (``seq_id``, ``num_computed_tokens``), never written.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from typing import NamedTuple

import numpy as np
import torch

# NOT_RESIDENT: a page-table entry for a page whose KV is not in the pool (it left a window)
from llm_core.caches.seq_kv import NOT_RESIDENT
from llm_core.request import Sequence


class PageTables(NamedTuple):
    """AttentionBatch inputs for a packed batch, one entry per KV group in the sequences' row order
    (see llm_core/kernels/attention_batch.py)."""

    page_tables: tuple[torch.Tensor, ...]  # int32 [B, P]; NOT_RESIDENT where absent and as padding
    slots: tuple[torch.Tensor, ...]  # int64 [T]


class TokenPositions(NamedTuple):
    """Where each of a step's packed new tokens belongs (int64 [T] each)."""

    seq: np.ndarray  # index of its sequence in the batch
    position: np.ndarray  # its position in that sequence


def token_positions(
    seqs: list[Sequence], num_new_tokens: list[int], starts: list[int] | None = None
) -> TokenPositions:
    """The sequence and position of each of the ``num_new_tokens[b]`` tokens of ``seqs[b]`` that
    start at ``starts[b]`` (default: ``num_computed_tokens``), packed back to back: array
    operations, no per-token loop."""
    counts = np.array(num_new_tokens, dtype=np.int64)  # [B]
    first = [s.num_computed_tokens for s in seqs] if starts is None else starts
    starts_arr = np.array(first, dtype=np.int64)  # [B]
    first_row = np.cumsum(counts) - counts  # [B] packed row of each sequence's first new token
    # token t of sequence b (row first_row[b] + k) is at position starts[b] + k
    position = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(starts_arr - first_row, counts)
    return TokenPositions(np.repeat(np.arange(len(seqs)), counts), position)


def build_page_tables(
    seqs: list[Sequence],
    page_rows: list[list[list[int]]],
    num_new_tokens: list[int],
    page_size: int,
    tokens: TokenPositions | None = None,
) -> PageTables:
    """Page tables and write slots for computing ``num_new_tokens[b]`` tokens of ``seqs[b]`` this step
    (``page_rows[b]``: the page rows per KV group of ``seqs[b]``, ``KVManager.rows``; ``tokens``:
    their ``token_positions``, when the caller has them already).

    Call after the KV manager allocated the step's pages and before ``num_computed_tokens`` moves.
    """
    tables = _page_table_arrays(seqs, page_rows)
    if tokens is None:
        tokens = token_positions(seqs, num_new_tokens)
    return _tables_and_slots(seqs, tables, tokens, page_size)


class DecodePageTables:
    """``build_page_tables(seqs, rows, [1] * len(seqs), page_size)`` for consecutive decode steps (one
    token per sequence, at ``positions[b] == seqs[b].num_computed_tokens``): the tables of the last
    call are kept with a copy of each row's page lists, and a call with as many sequences rewrites
    only the rows whose lists differ (from one step to the next, a sequence takes a new page every
    ``page_size`` steps and a sliding window drops one as often) instead of converting every row
    from Python lists (~25 ns per entry, the larger part of a decode step's inputs). Rows are
    compared by content, so the tables equal a fresh build whatever changed the lists."""

    def __init__(self) -> None:
        self._rows: list[list[list[int]]] = []  # copies of each sequence's rows, per group
        self._tables: list[np.ndarray] = []  # int32 [B, P] per group
        # The tables went into a step's tensors: copy them before patching a row (a step's
        # tensors never change afterwards), so that steps without changes copy nothing.
        self._shared = False

    def build(
        self, seqs: list[Sequence], rows: list[list[list[int]]], positions: np.ndarray, page_size: int
    ) -> PageTables:
        """``rows[b]``: the page rows per KV group of ``seqs[b]``."""
        if not self._patch(seqs, rows):
            self._tables = _page_table_arrays(seqs, rows)
            self._rows = [[list(r) for r in group_rows] for group_rows in rows]
        self._shared = True
        tokens = TokenPositions(np.arange(len(seqs)), positions)
        return _tables_and_slots(seqs, self._tables, tokens, page_size)

    def _patch(self, seqs: list[Sequence], rows: list[list[list[int]]]) -> bool:
        """Bring the kept tables up to date for ``seqs``; False when they must be rebuilt (another
        number of rows or groups, or a row longer than the tables are wide)."""
        if len(seqs) != len(self._rows) or not self._tables:
            return False
        width = self._tables[0].shape[1]
        changed = False
        for b, (group_rows, kept) in enumerate(zip(rows, self._rows, strict=True)):
            if group_rows == kept:  # lists of lists: compared in C, most rows most steps
                continue
            if len(group_rows) != len(self._tables):
                return False
            fresh = [list(r) for r in group_rows]
            if any(len(r) > width for r in fresh):
                return False
            if self._shared:
                self._tables, self._shared = [t.copy() for t in self._tables], False
            for table, row in zip(self._tables, fresh, strict=True):
                table[b] = row + [NOT_RESIDENT] * (width - len(row))
            self._rows[b] = fresh
            changed = True
        # as wide as the longest row, like a fresh build (only a changed row can have shrunk)
        return not changed or _width(self._rows) == width


def _tables_and_slots(
    seqs: list[Sequence], tables: list[np.ndarray], tokens: TokenPositions, page_size: int
) -> PageTables:
    """PageTables from int32 [B, P] tables (one per group) and each new token's sequence and
    position: the write slot of a token is its group page id * page_size + its offset in the page
    (``SeqKV.full_slot`` / ``swa_slot``), gathered for all tokens at once. The runner maps these
    group tables and slots to the layers' views (``PagedKVCache.page_map``)."""
    seq_of_token, positions = tokens
    pages = positions // page_size  # [T] logical page of each new token
    offsets = positions - pages * page_size
    slots = []
    for g, table in enumerate(tables):
        physical = table[seq_of_token, pages]  # raises IndexError for a page no table maps
        if physical.min(initial=0) < 0:  # NOT_RESIDENT: a window's page dropped, or beyond a row
            t = int(np.flatnonzero(physical < 0)[0])
            raise AssertionError(
                f"seq {seqs[seq_of_token[t]].seq_id}: page {int(pages[t])} of KV group {g} is not resident"
            )
        slots.append(torch.from_numpy(physical.astype(np.int64) * page_size + offsets))
    return PageTables(tuple(torch.from_numpy(t) for t in tables), tuple(slots))


def _width(rows: Iterable[SequenceOf[list[int]]]) -> int:
    """Table width for these rows: the longest (every group's row of a sequence is as long), at
    least 1."""
    return max(1, max((len(r[0]) if r else 0 for r in rows), default=0))


def _page_table_arrays(seqs: list[Sequence], rows: list[list[list[int]]]) -> list[np.ndarray]:
    """int32 [B, P] page tables of ``seqs``, one per KV group (P: the longest row, at least 1),
    padded with NOT_RESIDENT (never read: beyond seq_lens). Flat Python lists and one numpy
    conversion per table: ~25 ns per entry, where torch.tensor on lists is ~4x slower and a
    row-by-row fill ~2x."""
    width = _width(rows)
    pad = [NOT_RESIDENT] * width
    groups = max((len(r) for r in rows), default=0)
    flat: list[list[int]] = [[] for _ in range(groups)]
    for s, group_rows in zip(seqs, rows, strict=True):
        assert len(group_rows) == groups, f"seq {s.seq_id}: {len(group_rows)} page rows, not {groups}"
        for out, row in zip(flat, group_rows, strict=True):
            out += row
            out += pad[len(row) :]
    b = len(seqs)
    return [np.array(out, dtype=np.int32).reshape(b, width) for out in flat]
