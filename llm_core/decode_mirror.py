"""Dense per-batch copies of the decode KV for the torch (CPU) path, updated one column per step.

Why: a CPU decode step used to re-gather every sequence's visible keys and values from the paged
pools in every layer (tens of MB per step for a few kB of new KV). While the same sequences keep
decoding step after step, that gather repeats itself: only one new token per sequence changes.
So each layer keeps a dense mirror of what its decode queries read, and a step writes the new
column and attends over the mirror; the pools stay the source of truth (the mirror is rebuilt from
them, with one gather, whenever the batch is not the previous decode batch advanced by one token).

Layout per layer: k [B, Hkv, C, D], v [B, Hkv, C, Dv]. Column j of sequence b holds the latest
position p <= q_b with p = j (mod C), where q_b is the position of b's query:

    full layers   C >= every q_b + 1 (grown in steps of GROW)   column j = position j
    SWA layers    C = window W (a ring)                          column j = position q_b - ((q_b - j) mod W)

    ring, W = 4, q = 9:   column   0   1   2   3
                          position 8   9   6   7      (9 overwrote 5, which left the window)

In both cases the keys a query may see are exactly the columns j <= q_b (all of them once the
ring is full), so one mask per step serves every layer of a type. Columns never written hold a
finite copy of the query's own key (rebuild) or zeros, and are masked.

Reuse rule: the mirror is valid for this step when the previous forward on the same KV cache was
a decode step of the same B sequences in the same order, each now one token longer, with the
full-pool pages of their previous tokens unchanged (so the same sequences, reading the same KV).
Anything else (a prefill or mixed step, a sequence joining or leaving, preemption) rebuilds.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

# Full-layer mirrors grow their column capacity in multiples of this many positions.
GROW = 64


class DecodeStep(NamedTuple):
    """This step's decode batch, as the mirror sees it."""

    seq_lens: Tensor  # int64 [B]; query b sits at position seq_lens[b] - 1
    full_table: Tensor  # int32 [B, P] full-pool page table (identifies the sequences); padding arbitrary
    page_size: int


class LayerMirror(NamedTuple):
    k: Tensor  # [B, Hkv, C, D]
    v: Tensor  # [B, Hkv, C, Dv]


class DecodeMirror:
    """Dense decode KV of every layer for one KV cache and one run of consecutive decode steps."""

    def __init__(self) -> None:
        self._owner: object | None = None  # the KV cache the mirrors copy
        self._prev: DecodeStep | None = None  # the last decode step the mirrors are up to date with
        self._layers: dict[int, LayerMirror] = {}
        self._valid: set[int] = set()  # layers already advanced to the current step
        # Per step, shared by all layers: query positions [B], columns needed, per capacity C the
        # mask [B, 1, 1, C], and per (C, Hkv) the mirror rows the new tokens go to [B * Hkv].
        self._q_pos = torch.zeros(0, dtype=torch.int64)
        self._need = 0
        self._bias: dict[int, Tensor] = {}
        self._dest: dict[tuple[int, int], Tensor] = {}

    def begin(self, owner: object, step: DecodeStep | None) -> None:
        """Start a forward on ``owner``'s KV; ``step`` is None for anything but a decode step."""
        reuse = (
            step is not None
            and owner is self._owner
            and self._prev is not None
            and _continues(self._prev, step)
        )
        if not reuse:
            self._layers.clear()
        self._owner = owner
        self._prev = step
        self._valid.clear()
        self._bias.clear()
        self._dest.clear()
        if step is not None:
            self._q_pos = step.seq_lens - 1
            self._need = int(self._q_pos.max()) + 1

    def attend_inputs(
        self,
        layer: int,
        k_cache: Tensor,
        v_cache: Tensor,
        page_table: Tensor,
        window: int | None,
        k_new: Tensor,
        v_new: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Bring layer ``layer``'s mirror to this step (new k_new [B, Hkv, D] / v_new [B, Hkv, Dv]
        already written to the pools) -> (k [B, Hkv, C, D], v [B, Hkv, C, Dv], bias [B, 1, 1, C])."""
        assert self._prev is not None, "attend_inputs outside a decode step"
        assert layer not in self._valid, f"layer {layer} advanced twice in one step"
        q_pos = self._q_pos
        m = self._layers.get(layer)
        if m is not None and window is None and m.k.shape[2] < self._need:
            m = None  # a full layer outgrew its capacity: rebuild wider
        if m is None:
            cap = window if window is not None else -(-self._need // GROW) * GROW
            m = _rebuild(k_cache, v_cache, page_table, q_pos, cap, page_table.shape[1])
            self._layers[layer] = m
        num_seqs, num_kv, cap = m.k.shape[0], m.k.shape[1], m.k.shape[2]
        if cap not in self._bias:
            cols = torch.arange(cap, device=q_pos.device)
            bias = torch.zeros(num_seqs, cap, dtype=torch.float32, device=q_pos.device)
            bias.masked_fill_(cols[None, :] > q_pos[:, None], float("-inf"))
            self._bias[cap] = bias[:, None, None, :]
        dest = self._dest.get((cap, num_kv))
        if dest is None:
            # row of (b, h, column q_b mod C) in the mirror viewed as [B * Hkv * C, .]
            heads = torch.arange(num_kv, device=q_pos.device)
            dest = ((torch.arange(num_seqs, device=q_pos.device)[:, None] * num_kv + heads) * cap).add_(
                (q_pos % cap)[:, None]
            )
            dest = self._dest[(cap, num_kv)] = dest.reshape(-1)  # [B * Hkv]
        # rebuilt mirrors already hold the new column: rewriting it stores the same values
        m.k.view(-1, m.k.shape[3]).index_copy_(0, dest, k_new.reshape(-1, k_new.shape[2]).to(m.k.dtype))
        m.v.view(-1, m.v.shape[3]).index_copy_(0, dest, v_new.reshape(-1, v_new.shape[2]).to(m.v.dtype))
        self._valid.add(layer)
        return m.k, m.v, self._bias[cap]


def _continues(prev: DecodeStep, step: DecodeStep) -> bool:
    """True when ``step`` is ``prev``'s batch, same order, each sequence one token further on the
    same full-pool pages."""
    if step.seq_lens.shape != prev.seq_lens.shape:
        return False
    if not torch.equal(step.seq_lens, prev.seq_lens + 1):
        return False
    width = prev.full_table.shape[1]
    if step.full_table.shape[1] < width or step.page_size != prev.page_size:
        return False
    # Compare the pages holding each sequence's previous tokens; entries past them are padding.
    covered = (prev.seq_lens - 1) // prev.page_size  # [B] last page with a previous token
    cols = torch.arange(width, device=covered.device)
    same = (step.full_table[:, :width] == prev.full_table) | (cols[None, :] > covered[:, None])
    return bool(same.all())


def _rebuild(
    k_cache: Tensor, v_cache: Tensor, page_table: Tensor, q_pos: Tensor, cap: int, num_pages: int
) -> LayerMirror:
    """Gather every column from the pools (see the module doc for which position a column holds)."""
    page_size, num_kv, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    cols = torch.arange(cap, device=q_pos.device)
    pos = q_pos[:, None] - (q_pos[:, None] - cols[None, :]) % cap  # [B, C]
    pos = torch.where(pos >= 0, pos, q_pos[:, None])  # never-written columns copy the query's own key
    pages = page_table.to(torch.int64).gather(1, (pos // page_size).clamp(max=num_pages - 1))
    assert bool((pages >= 0).all()), "a page inside some query's window is not resident"
    slots = pages * page_size + pos % page_size  # [B, C]
    heads = torch.arange(num_kv, device=q_pos.device)
    rows = (slots[:, None, :] * num_kv + heads[None, :, None]).reshape(-1)  # [B * Hkv * C]
    num_seqs = q_pos.shape[0]
    k = k_cache.view(-1, head_dim).index_select(0, rows).view(num_seqs, num_kv, cap, head_dim)
    v = v_cache.view(-1, v_cache.shape[-1]).index_select(0, rows).view(num_seqs, num_kv, cap, -1)
    return LayerMirror(k, v)
