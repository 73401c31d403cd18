"""One request's state in the LLM core: its tokens, cache keys, page tables and progress.

The scheduler and the KV manager mutate a ``Sequence``; the model runner only reads it. The
sequence knows nothing of sampling (``sampling`` is opaque here) or of how pages are chosen.

Token layout::

    token_ids   = prompt_ids + output_ids           what the model computes, position by position
    cache_keys  = prompt_keys + output_ids          what the prefix cache matches on
    prompt_keys = prompt_ids with each media placeholder run replaced by a pseudo-id of its MediaKey

    positions   [0 ............ num_computed_tokens) KV written (full pool; SWA pool only the window)
                [num_computed_tokens .. num_tokens)  still to compute (the last one is the decode input)

Page tables (``full_pages``, ``swa_pages``) map logical page ``i`` (positions [i*page, (i+1)*page))
to a physical page of each pool; ``swa_pages[i] == -1`` means that page's SWA KV is not resident
(it left the window, or the prefix cache never had to keep it). The first ``num_borrowed_pages``
entries of both rows belong to the radix prefix cache (locked while this sequence runs), the rest
belong to the sequence.
"""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

NOT_RESIDENT = -1  # SWA page-table entry for a page whose SWA KV is not in the pool


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and reset to recompute)
    RUNNING = "running"  # holds KV pages and is scheduled every step
    FINISHED = "finished"  # stopped normally; pages released
    ABORTED = "aborted"  # cancelled by the client or the engine; pages released


class MediaSpan(NamedTuple):
    """A placeholder run in the prompt: ``length`` pad tokens at ``start`` for the media ``key``."""

    start: int
    length: int
    key: str


class MediaSpanError(ValueError):
    """The prompt's placeholder runs do not match the media supplied with the request (400)."""

    status = 400


def media_pseudo_id(key: str) -> int:
    """A negative id derived from a MediaKey; it never collides with a vocabulary id (all >= 0).

    Every token of a placeholder run gets the same pseudo-id: the run's position and length are
    already fixed by the tokens before it, so one id per run is enough to keep different media
    apart while the same media at the same place still shares the prefix.
    """
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return -1 - (int.from_bytes(digest, "big") >> 1)


def find_placeholder_runs(prompt_ids: Iterable[int], placeholder_ids: Iterable[int]) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of one placeholder id, in prompt order."""
    pad = set(placeholder_ids)
    runs: list[tuple[int, int]] = []
    prev = None
    for i, t in enumerate(prompt_ids):
        if t in pad and t == prev:
            s, n = runs[-1]
            runs[-1] = (s, n + 1)
        elif t in pad:
            runs.append((i, 1))
        prev = t
    return runs


def media_spans(prompt_ids: list[int], placeholder_ids: Iterable[int], keys: list[str]) -> list[MediaSpan]:
    """Pair the prompt's placeholder runs (in order) with the media keys; typed error on mismatch."""
    runs = find_placeholder_runs(prompt_ids, placeholder_ids)
    if len(runs) != len(keys):
        raise MediaSpanError(
            f"prompt has {len(runs)} media placeholder runs but {len(keys)} media were given"
        )
    return [MediaSpan(s, n, k) for (s, n), k in zip(runs, keys, strict=True)]


def build_cache_keys(prompt_ids: list[int], spans: Iterable[MediaSpan]) -> list[int]:
    keys = list(prompt_ids)
    for span in spans:
        if span.start < 0 or span.start + span.length > len(keys):
            raise MediaSpanError(f"media span {span} lies outside the prompt of {len(keys)} tokens")
        pid = media_pseudo_id(span.key)
        keys[span.start : span.start + span.length] = [pid] * span.length
    return keys


@dataclass(eq=False)
class Sequence:
    """A request inside the engine. Identity semantics (``eq=False``): two sequences are never equal."""

    seq_id: int | str
    prompt_ids: list[int]
    sampling: Any = None  # the engine's SamplingParams; opaque to the scheduler and the KV manager
    max_new_tokens: int = 16
    stop_token_ids: frozenset[int] = frozenset()
    media: list[MediaSpan] = field(default_factory=list)
    mm_items: list[Any] = field(default_factory=list)  # the runner's multimodal inputs, in span order
    arrival_time: float = field(default_factory=time.monotonic)

    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at the last admission
    num_preemptions: int = 0
    # KV state, owned by the KV manager.
    full_pages: list[int] = field(default_factory=list)
    swa_pages: list[int] = field(default_factory=list)
    num_borrowed_pages: int = 0
    num_swa_released: int = 0  # leading logical SWA pages already dropped (NOT_RESIDENT unless pinned)
    swa_pin_end: int = 0  # keep the SWA window before this position until release (heals a branch point)
    prefix_lock: Any = None  # radix_cache.PrefixLock while holding a prefix-cache hit
    # Leading tokens whose KV a later prompt with the same cache keys would compute identically
    # (None: all). The model's position scheme lowers it when generated tokens sit at positions a
    # prompt would not give them (``positions.MRopePositions``); only that much enters the cache.
    cacheable_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"sequence {self.seq_id!r}: empty prompt")
        self._prompt_keys = build_cache_keys(self.prompt_ids, self.media)

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
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """More than the one decode input token is left to compute (prompt, or recompute after preemption)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.ABORTED)

    def full_slot(self, pos: int, page_size: int) -> int:
        return self.full_pages[pos // page_size] * page_size + pos % page_size

    def swa_slot(self, pos: int, page_size: int) -> int:
        page = self.swa_pages[pos // page_size]
        assert page != NOT_RESIDENT, f"seq {self.seq_id}: SWA page of position {pos} is not resident"
        return page * page_size + pos % page_size


class PageTables(NamedTuple):
    """AttentionBatch inputs for a packed batch (see llm_core/kernels/attention_batch.py)."""

    full_page_table: torch.Tensor  # int32 [B, P]; padding 0 (never read: beyond seq_lens)
    swa_page_table: torch.Tensor  # int32 [B, P]; NOT_RESIDENT where the SWA KV is absent
    full_slots: torch.Tensor  # int64 [T]
    swa_slots: torch.Tensor  # int64 [T]


def build_page_tables(seqs: list[Sequence], num_new_tokens: list[int], page_size: int) -> PageTables:
    """Page tables and write slots for computing ``num_new_tokens[b]`` tokens of ``seqs[b]`` this step.

    Call after the KV manager allocated the step's pages and before ``num_computed_tokens`` moves.
    """
    width = max(1, max((len(s.full_pages) for s in seqs), default=0))
    # Flat Python lists, one numpy conversion per tensor (torch.tensor on lists is ~2x slower).
    full_rows: list[int] = []
    swa_rows: list[int] = []
    full_slots: list[int] = []
    swa_slots: list[int] = []
    for s, n in zip(seqs, num_new_tokens, strict=True):
        full, swa = s.full_pages, s.swa_pages
        assert len(swa) <= width, "an SWA table longer than the full one"
        full_rows += full
        full_rows += [0] * (width - len(full))
        swa_rows += swa
        swa_rows += [NOT_RESIDENT] * (width - len(swa))
        # write slots of positions start .. end - 1, one run per page (Sequence.full_slot / swa_slot)
        start, end = s.num_computed_tokens, s.num_computed_tokens + n
        for page in range(start // page_size, (end - 1) // page_size + 1):
            base = page * page_size
            lo, hi = max(start, base) - base, min(end, base + page_size) - base
            assert swa[page] != NOT_RESIDENT, f"seq {s.seq_id}: SWA page {page} is not resident"
            f, w = full[page] * page_size, swa[page] * page_size
            full_slots += range(f + lo, f + hi)
            swa_slots += range(w + lo, w + hi)
    b = len(seqs)
    return PageTables(
        torch.from_numpy(np.array(full_rows, dtype=np.int32).reshape(b, width)),
        torch.from_numpy(np.array(swa_rows, dtype=np.int32).reshape(b, width)),
        torch.from_numpy(np.array(full_slots, dtype=np.int64)),
        torch.from_numpy(np.array(swa_slots, dtype=np.int64)),
    )
