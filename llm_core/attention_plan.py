"""Per-step attention plans for the torch (CPU) path: gather indices and additive masks built once
per forward step for each layer type, then shared by every layer of that type.

Why: on CPU a decode step used to spend most of its time gathering whole KV pages and filling
big boolean masks in every layer. All full layers read through one page table and all SWA layers
through another, so the index arithmetic is done once per step and each layer does one
``index_select`` for k and one for v, straight into the layout the matmuls want.

Decode (one query per sequence; query b sits at position q_b = seq_lens[b] - 1)::

    keys of seq b     kv_start_b = max(0, q_b - W + 1)   (0 without a window)  ..  q_b
    column j          position kv_start_b + j,   j < M = max_b (q_b - kv_start_b + 1)

    seq 0   | k k k k k k k |                 q_0 - kv_start_0 + 1 = M
    seq 1   | k k k k . . . |   '.' = padding: reads seq 1's own new slot (written this step,
                                   so finite) and gets bias -inf

    rows[b, h, j] = slot(kv_start_b + j) * Hkv + h      (k viewed as [N * page * Hkv, D])

Prefill (chunks of several queries per sequence): sequences without a cached prefix attend over
this step's k/v directly (no page gather at all); the others gather exactly the key positions
their queries can see. Queries run in blocks of ``q_block`` rows with an additive [n, m] bias.

Semantics are those of ``attention.masked_attention`` (window counts the query; sinks are
value-less per-head logits).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from llm_core.decode_mirror import DecodeMirror

# A mixed step sends its single-token sequences through the batched decode path when there are at
# least this many (below it, the per-sequence prefill path costs about the same).
MIN_DECODE_GROUP = 2

# Prefill queries run in blocks of this many rows: a block reads keys only up to its last query,
# so smaller blocks skip more of the causal upper triangle (and the exp of its -inf scores, slow on
# CPU), at a fixed cost of ~15 ops per block. On bench.llm's prompts (32-256 tokens), one SWA plus
# one full layer over the 32 prompts took 108 / 114 / 146 ms (best of 6) with blocks of 64 / 128 / 256.
PREFILL_Q_BLOCK = 64


class DecodePlan(NamedTuple):
    """Gather plan for one layer type in a decode step (every sequence has one new token)."""

    slots: Tensor  # int64 [B, M] flat KV slot of key column j of sequence b
    bias: Tensor  # fp32 [B, 1, 1, M] 0 for keys the query sees, -inf for padding columns


def plan_decode(page_table: Tensor, seq_lens: Tensor, page_size: int, window: int | None) -> DecodePlan:
    """Build the decode gather plan from a page table [B, P] and seq_lens [B] (see module doc)."""
    q_pos = seq_lens.to(torch.int64) - 1  # [B]
    kv_start = torch.zeros_like(q_pos) if window is None else (q_pos - window + 1).clamp(min=0)
    num_keys = q_pos - kv_start + 1  # [B]
    width = int(num_keys.max())
    cols = torch.arange(width, device=seq_lens.device)  # [M]
    pos = kv_start[:, None] + cols[None, :]  # [B, M]
    valid = cols[None, :] < num_keys[:, None]  # [B, M]
    pos = torch.minimum(pos, q_pos[:, None])  # padding reads the query's own (fresh) slot
    pages = page_table.to(torch.int64).gather(1, pos // page_size)  # [B, M]
    assert bool((pages >= 0).all()), "a page inside some query's window is not resident"
    slots = pages * page_size + pos % page_size
    bias = torch.zeros(valid.shape, dtype=torch.float32, device=seq_lens.device)
    bias.masked_fill_(~valid, float("-inf"))
    return DecodePlan(slots, bias[:, None, None, :])


def softmax_with_sinks(scores: Tensor, sinks: Tensor | None) -> Tensor:
    """softmax([scores..., sink])[..., :-1] without materialising the extra column; fp32 scores
    [..., M] are overwritten (the caller's temporary). ``sinks`` broadcasts against scores[..., :1].

        m = max(max_j s_j, sink)      p_j = e^(s_j - m) / (sum_i e^(s_i - m) + e^(sink - m))

    The sink is finite, so m is too, even for a row whose keys are all masked (-inf).
    """
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float()
    m = torch.maximum(scores.amax(-1, keepdim=True), sink)  # [..., 1]
    e = scores.sub_(m).exp_()
    return e.div_(e.sum(-1, keepdim=True).add_((sink - m).exp_()))


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    plan: DecodePlan,
    scale: float,
    sinks: Tensor | None,
    rows: Tensor | None = None,
) -> Tensor:
    """q [B, H, D] over the planned keys of paged k_cache [N, page, Hkv, D] / v_cache [N, page, Hkv, Dv]
    -> [B, H, Dv] in q's dtype. ``rows`` (from :func:`kv_rows`) may be passed in to share it across
    layers with the same KV-head count."""
    num_seqs, _, head_dim = q.shape
    num_kv = k_cache.shape[2]
    width = plan.slots.shape[1]
    if rows is None:
        rows = kv_rows(plan, num_kv)
    k = k_cache.view(-1, head_dim).index_select(0, rows).view(num_seqs, num_kv, width, head_dim)
    v = v_cache.view(-1, v_cache.shape[-1]).index_select(0, rows).view(num_seqs, num_kv, width, -1)
    return dense_decode_attention(q, k, v, plan.bias, scale, sinks)


def dense_decode_attention(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float, sinks: Tensor | None
) -> Tensor:
    """q [B, H, D] over dense k [B, Hkv, M, D] / v [B, Hkv, M, Dv] with an additive bias [B, 1, 1, M]
    (0 or -inf; every masked column must hold finite values) -> [B, H, Dv] in q's dtype.

    Scores are computed keys-major, [M, D] x [D, G] per (sequence, KV head): with only G query
    heads per KV head, MKL's batched GEMM runs this orientation ~1.2x (G = 2) to ~1.4x (G = 4)
    faster than [G, D] x [D, M] on cold (just evicted) keys, which is what decode reads (a microbenchmark;
    in bench.llm's decode steps, where other work dominates, it is ~1% of the step)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv, width = k.shape[1], k.shape[2]
    group = num_heads // num_kv
    # fp32 scores and softmax whatever the cache dtype (.float() is free for fp32 tensors)
    qf = q.float().reshape(num_seqs * num_kv, group, head_dim)  # [B * Hkv, G, D]
    kf = k.float().reshape(num_seqs * num_kv, width, head_dim)  # [B * Hkv, M, D]
    scores_t = torch.bmm(kf, qf.transpose(1, 2)).view(num_seqs, num_kv, width, group)  # [B, Hkv, M, G]
    # out=: a contiguous [B, Hkv, G, M] (addcmul would otherwise keep the transposed layout)
    scores = torch.empty(num_seqs, num_kv, group, width, dtype=torch.float32, device=q.device)
    torch.addcmul(bias, scores_t.transpose(-1, -2), _scalar(scale, q.device), out=scores)
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(1, num_kv, group, 1))
    out = torch.matmul(probs, v.float())  # [B, Hkv, G, Dv]
    return out.reshape(num_seqs, num_heads, -1).to(q.dtype)


@functools.lru_cache(maxsize=64)
def _scalar(value: float, device: torch.device) -> Tensor:
    """A cached fp32 0-dim tensor (addcmul's multiplier; read only)."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def kv_rows(plan: DecodePlan, num_kv: int) -> Tensor:
    """int64 [B * Hkv * M] rows of a pool viewed as [N * page * Hkv, D] for layers with ``num_kv`` KV
    heads (share it across layers): row = slot * Hkv + head, laid out [B, Hkv, M] so the gather
    lands in the layout the matmuls read."""
    heads = torch.arange(num_kv, device=plan.slots.device)
    return (plan.slots[:, None, :] * num_kv + heads[None, :, None]).reshape(-1)


class PrefillSeq(NamedTuple):
    """One sequence of a prefill step, as plain ints (read once per step, not per layer)."""

    lo: int  # its rows in the packed batch: [lo, hi)
    hi: int
    seq_len: int  # tokens after this step; the queries sit at seq_len - (hi - lo) .. seq_len - 1
    b: int  # its index in the batch (its page-table row)


def prefill_seqs(cu_seqlens_q: Tensor, seq_lens: Tensor) -> list[PrefillSeq]:
    cu = cu_seqlens_q.tolist()
    return [PrefillSeq(cu[b], cu[b + 1], n, b) for b, n in enumerate(seq_lens.tolist())]


def prefill_attention(
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    seqs: list[PrefillSeq],
    scale: float,
    window: int | None,
    sinks: Tensor | None,
    q_block: int = PREFILL_Q_BLOCK,
) -> Tensor:
    """Varlen prefill: q [T, H, D] packed as ``seqs`` -> [T, H, Dv] in q's dtype (only the rows of
    ``seqs`` are written; a step's single-token sequences may be left to ``decode_attention``).

    k_new [T, Hkv, D] / v_new [T, Hkv, Dv] are this step's keys and values (already written to
    the pools). A sequence with no cached prefix reads them directly; one with a cached prefix
    gathers the key positions its queries can see from the pools::

        positions  kv_start = (q_first - W + 1, or 0)      q_first              seq_len
                   |<---- gathered from the pools (slots) ---->|<-- this chunk -->|
    """
    page_size = k_cache.shape[1]
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])  # rows of sequences not in seqs: unset
    for s in seqs:
        n = s.hi - s.lo
        q_first = s.seq_len - n
        kv_start = 0 if window is None else max(0, q_first - window + 1)
        if kv_start == q_first:  # nothing cached is visible: attend over this chunk only
            k, v = k_new[s.lo : s.hi], v_new[s.lo : s.hi]
        else:
            pos = torch.arange(kv_start, s.seq_len, device=q.device)
            slots = _slots(page_table, s.b, pos, page_size)
            k = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, slots)  # [m, Hkv, D]
            v = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, slots)  # [m, Hkv, Dv]
        out[s.lo : s.hi] = _blocked(q[s.lo : s.hi], k, v, q_first, kv_start, scale, window, sinks, q_block)
    return out


def _slots(page_table: Tensor, b: int, pos: Tensor, page_size: int) -> Tensor:
    pages = page_table[b].to(torch.int64)[pos // page_size]
    assert bool((pages >= 0).all()), f"sequence {b}: a page its queries can see is not resident"
    return pages * page_size + pos % page_size


def _blocked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_first: int,
    k_first: int,
    scale: float,
    window: int | None,
    sinks: Tensor | None,
    q_block: int,
) -> Tensor:
    """One sequence: q [n, H, D] at positions q_first.., k [m, Hkv, D] / v [m, Hkv, Dv] at k_first..
    (k ends where q ends). Query blocks read only the key range they can see, so a causal block
    skips the keys after its last query (and the exp of their -inf scores). -> [n, H, Dv].

    The G query heads of a KV head ride in the rows of one matmul ([Hkv, G * nb, D] x [Hkv, D, mb]),
    so keys are never repeated per query head."""
    n, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    out = q.new_empty(n, num_heads, v.shape[-1])
    kt = k.float().permute(1, 2, 0)  # [Hkv, D, m]
    vh = v.float().permute(1, 0, 2)  # [Hkv, m, Dv]
    qh = q.float().view(n, num_kv, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D] (a view)
    scale_t = torch.tensor(scale, dtype=torch.float32)
    sink = None if sinks is None else sinks.view(num_kv, group, 1, 1)
    for a in range(0, n, q_block):
        z = min(a + q_block, n)
        nb = z - a
        qp0, qp1 = q_first + a, q_first + z  # query positions [qp0, qp1)
        kp0 = k_first if window is None else max(k_first, qp0 - window + 1)
        ka, kz = kp0 - k_first, qp1 - k_first  # key columns [ka, kz)
        bias = _block_bias(nb, kz - ka, qp0 - kp0, window, q.device)  # [nb, mb]
        qb = qh[:, :, a:z].reshape(num_kv, group * nb, head_dim)  # [Hkv, G * nb, D]
        scores = torch.bmm(qb, kt[:, :, ka:kz]).view(num_kv, group, nb, kz - ka)  # [Hkv, G, nb, mb]
        scores = torch.addcmul(bias, scores, scale_t)
        probs = softmax_with_sinks(scores, sink)
        o = torch.bmm(probs.view(num_kv, group * nb, -1), vh[:, ka:kz])  # [Hkv, G * nb, Dv]
        out[a:z] = o.view(num_kv, group, nb, -1).permute(2, 0, 1, 3).reshape(nb, num_heads, -1)
    return out


@functools.lru_cache(maxsize=128)  # entries are at most q_block x (q_block + window) floats
def _block_bias(rows: int, cols: int, offset: int, window: int | None, device: torch.device) -> Tensor:
    """fp32 [rows, cols] additive mask of a query block: query i sits ``offset`` positions after key
    column 0, so it sees column j iff ``j - i <= offset`` (causal) and ``j - i > offset - window``.
    Cached (the same few shapes recur in every layer and every sequence); callers never write it."""
    rel = torch.arange(cols, device=device)[None, :] - torch.arange(rows, device=device)[:, None]
    allowed = rel <= offset
    if window is not None:
        allowed &= rel > offset - window
    bias = torch.zeros(rows, cols, dtype=torch.float32, device=device)
    return bias.masked_fill_(~allowed, float("-inf"))


class StepPlan:
    """Everything the torch attention path derives from an AttentionBatch, computed lazily on first
    use in a step and reused by every later layer of the same type (and rotary tables per theta).

    Sequences with a single new token (decoding ones, even inside a step that also prefills others)
    go through the batched decode path; the rest through the per-sequence prefill path::

        packed rows   [ s0: 1 | s1: 40 | s2: 1 | s3: 1 | s4: 17 ]
        decode        s0, s2, s3   rows cu[0], cu[2], cu[3]   one batched decode_attention
        prefill       s1, s4                                  prefill_attention, one call per sequence
    """

    def __init__(
        self, page_tables: dict[bool, Tensor], cu_seqlens_q: Tensor, seq_lens: Tensor, max_seqlen_q: int
    ) -> None:
        self.page_tables = page_tables  # is_swa -> [B, P]
        self.cu_seqlens_q = cu_seqlens_q
        self.seq_lens = seq_lens
        self.is_decode = max_seqlen_q == 1 and cu_seqlens_q.shape[0] - 1 == seq_lens.shape[0]
        self._decode: dict[bool, DecodePlan] = {}
        self._rows: dict[tuple[bool, int], Tensor] = {}
        self._prefill: list[PrefillSeq] | None = None
        self._decode_rows: Tensor | None = None  # packed rows of the single-token sequences (mixed step)
        self._decode_seqs: Tensor | None = None  # their batch indices
        self._rope: dict[tuple[int, float], tuple[Tensor, Tensor]] = {}
        self.mirror: DecodeMirror | None = None  # set by the model for decode steps (see decode_mirror)

    def _split(self) -> None:
        """Sort a mixed step's sequences into decode (one new token) and prefill ones."""
        seqs = prefill_seqs(self.cu_seqlens_q, self.seq_lens)
        single = [s for s in seqs if s.hi - s.lo == 1]
        if len(single) >= MIN_DECODE_GROUP:
            dev = self.seq_lens.device
            self._decode_rows = torch.tensor([s.lo for s in single], dtype=torch.int64, device=dev)
            self._decode_seqs = torch.tensor([s.b for s in single], dtype=torch.int64, device=dev)
            seqs = [s for s in seqs if s.hi - s.lo > 1]
        self._prefill = seqs

    def decode(self, is_swa: bool, page_size: int, window: int | None) -> DecodePlan:
        """The decode plan of every sequence (a decode step) or of the single-token ones (mixed)."""
        if is_swa not in self._decode:
            table, seq_lens = self.page_tables[is_swa], self.seq_lens
            if not self.is_decode:
                assert self._decode_seqs is not None, "a mixed step without single-token sequences"
                table, seq_lens = table.index_select(0, self._decode_seqs), seq_lens[self._decode_seqs]
            self._decode[is_swa] = plan_decode(table, seq_lens, page_size, window)
        return self._decode[is_swa]

    def rows(self, is_swa: bool, num_kv: int) -> Tensor:
        key = (is_swa, num_kv)
        if key not in self._rows:
            self._rows[key] = kv_rows(self._decode[is_swa], num_kv)
        return self._rows[key]

    def prefill(self) -> list[PrefillSeq]:
        """The sequences for ``prefill_attention`` (all of them unless single-token ones split off)."""
        if self._prefill is None:
            self._split()
        assert self._prefill is not None
        return self._prefill

    def decode_rows(self) -> Tensor | None:
        """Packed rows of a mixed step's single-token sequences, or None when they are not split off."""
        if self._prefill is None:
            self._split()
        return self._decode_rows

    def rope(
        self, key: tuple[int, float], make: Callable[[], tuple[Tensor, Tensor]]
    ) -> tuple[Tensor, Tensor]:
        """Rotary (cos, sin) for this step's positions, made once per (rope_dim, theta)."""
        if key not in self._rope:
            self._rope[key] = make()
        return self._rope[key]
