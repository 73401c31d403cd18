"""One request's state in the LLM core: its tokens, cache keys and progress; page tables from rows.

The request itself (prompt, sampling, media) is a frozen ``request.Request`` the sequence refers
to; the scheduler and the KV manager move the rest of a ``Sequence`` (tokens, progress, status); the
model runner only reads it. The sequence knows nothing of pages.

Token layout::

    token_ids   = prompt_ids + output_ids           what the model computes, position by position
    cache_keys  = prompt_keys + output_ids          what the prefix cache matches on
    prompt_keys = prompt_ids with each media placeholder run replaced by a pseudo-id of its MediaKey

    positions   [0 ............ num_computed_tokens) KV written (full attention: all; a window: its window)
                [num_computed_tokens .. num_tokens)  still to compute (the last one is the decode input)

The sequence holds no KV state: its pages, pins and prefix lock are the KV manager's
(``caches.seq_kv.SeqKV``, kept by request id); the page-table builders below take each
sequence's page rows from the caller (the scheduler's ``SchedulerOutput``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from typing import NamedTuple

import numpy as np
import torch

# The media-span parsing and the cache-key rule are shared with the ingress (it routes on the
# keys the prefix cache matches): they live with the other messages between roles.
from epd_common.messages.cache_keys import MediaSpan, build_cache_keys

# a page-table entry for a page whose KV is not in the pool (left a window): the KV state's
from llm_core.caches.seq_kv import NOT_RESIDENT
from llm_core.serving.request import MultimodalInput, Request, RequestId
from llm_core.serving.sampling import SamplingParams

# What a step yields per sequence: a token, None (a prefill chunk short of the end), or the tokens a
# verify step accepted (speculative decoding, ``speculative.py``).
Sampled = int | list[int] | None


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and reset to recompute)
    RUNNING = "running"  # holds KV pages and is scheduled every step
    FINISHED = "finished"  # stopped normally; pages released
    ABORTED = "aborted"  # cancelled by the client or the engine; pages released


class Sequence:
    """The scheduler's state of one request: a reference to the frozen ``Request`` and what
    scheduling moves. Identity semantics: two sequences are never equal (hashable by identity)."""

    request: Request
    output_ids: list[int]
    status: SequenceStatus
    finish_reason: str | None  # "stop" | "length" | "abort"
    num_computed_tokens: int
    num_cached_tokens: int  # prefix-cache hit at the last admission
    num_preemptions: int
    # Leading tokens whose KV a later prompt with the same cache keys would compute identically
    # (None: all). The model's position scheme lowers it when generated tokens sit at positions a
    # prompt would not give them (``positions.MRopePositions``); only that much enters the cache.
    cacheable_tokens: int | None

    def __init__(
        self,
        seq_id: RequestId,
        prompt_ids: Iterable[int],
        sampling: SamplingParams | None = None,
        max_new_tokens: int = 16,
        stop_token_ids: Iterable[int] = (),
        media: Iterable[MediaSpan] = (),
        mm_items: Iterable[MultimodalInput] = (),
        arrival_time: float | None = None,
    ) -> None:
        """A sequence of a request built from these fields (``Sequence.of`` takes a ``Request``)."""
        self._start(
            Request.create(
                seq_id, prompt_ids, sampling, max_new_tokens, stop_token_ids, media, mm_items, arrival_time
            )
        )

    @classmethod
    def of(cls, request: Request) -> Sequence:
        """The scheduler's state for ``request``, nothing computed yet."""
        seq = cls.__new__(cls)
        seq._start(request)
        return seq

    def _start(self, request: Request) -> None:
        if not request.prompt_ids:
            raise ValueError(f"sequence {request.request_id!r}: empty prompt")
        self.request = request
        # a list copy: token_ids concatenates it with output_ids every step
        self._prompt_list = list(request.prompt_ids)
        self._prompt_keys = build_cache_keys(self._prompt_list, request.media)
        self.output_ids = []
        self.status = SequenceStatus.WAITING
        self.finish_reason = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.cacheable_tokens = None

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, {self.num_prompt_tokens} prompt + {len(self.output_ids)} output tokens,"
            f" {self.num_computed_tokens} computed, {self.status.value})"
        )

    # ---- the request's fields (read-only) ------------------------------------------------------

    @property
    def seq_id(self) -> RequestId:
        return self.request.request_id

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt (a list view of ``request.prompt_ids``; never written)."""
        return self._prompt_list

    @property
    def sampling(self) -> SamplingParams | None:
        return self.request.sampling

    @property
    def max_new_tokens(self) -> int:
        return self.request.max_new_tokens

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.request.stop_token_ids

    @property
    def media(self) -> tuple[MediaSpan, ...]:
        return self.request.media

    @property
    def mm_items(self) -> tuple[MultimodalInput, ...]:
        return self.request.mm_items

    @property
    def arrival_time(self) -> float:
        return self.request.arrival_time

    @property
    def kv_export(self) -> bool:
        return self.request.kv_export

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole list (a decode step needs one id)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : end - p]
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    @property
    def cache_keys(self) -> list[int]:
        return self._prompt_keys + self.output_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """More than the one decode input token is left to compute (prompt, or recompute after preemption)."""
        # num_uncomputed_tokens > 1, spelled out: the scheduler asks for every sequence every step
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED)


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
    group tables and slots to the layers' views (``DualKVCache.page_map``)."""
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
