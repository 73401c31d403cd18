"""Paged attention: the torch path against a dense reference, and the Triton kernels (run by the
interpreter on CPU) against the torch path.

Pools are filled with NaN except for the slots the batch owns, pages are scattered over the pool,
and SWA pages that left every window are unmapped (-1) and poisoned, so reading one slot too many,
mis-mapping a page, or masking a window off by one shows up as NaN or a large error.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core.kernels.attention import (
    masked_attention,
    paged_attention,
    paged_attention_torch,
    paged_decode_torch,
    write_kv,
)

PAGE = 16


class Case(NamedTuple):
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [N, page, Hkv, D]
    v_cache: torch.Tensor  # [N, page, Hkv, Dv]
    table: torch.Tensor  # [B, P]
    cu: torch.Tensor  # [B+1]
    seq_lens: torch.Tensor  # [B]
    keys: list[torch.Tensor]  # per sequence k [L, Hkv, D] (positions 0..L-1)
    values: list[torch.Tensor]  # per sequence v [L, Hkv, Dv]
    max_q: int


def make_case(
    seq_lens: list[int],
    q_lens: list[int],
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    v_dim: int = 16,
    window: int | None = None,
    seed: int = 0,
) -> Case:
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(math.ceil(n / PAGE) for n in seq_lens) + 2
    k_cache = torch.full((num_pages, PAGE, kv_heads, head_dim), float("nan"))
    v_cache = torch.full((num_pages, PAGE, kv_heads, v_dim), float("nan"))
    free = torch.randperm(num_pages, generator=g).tolist()
    width = max(math.ceil(n / PAGE) for n in seq_lens)
    table = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    keys, values, qs = [], [], []
    for b, (n, nq) in enumerate(zip(seq_lens, q_lens, strict=True)):
        pages = [free.pop() for _ in range(math.ceil(n / PAGE))]
        table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        k = torch.randn(n, kv_heads, head_dim, generator=g)
        v = torch.randn(n, kv_heads, v_dim, generator=g)
        pos = torch.arange(n)
        slots = torch.tensor(pages)[pos // PAGE] * PAGE + pos % PAGE
        write_kv(k_cache, v_cache, slots, k, v)
        if window is not None:
            # Unmap (and poison) pages no query of this sequence can see.
            first_needed = max(0, n - nq - window + 1)
            for i in range(first_needed // PAGE):
                k_cache[pages[i]].fill_(float("nan"))
                v_cache[pages[i]].fill_(float("nan"))
                table[b, i] = -1
        keys.append(k)
        values.append(v)
        qs.append(torch.randn(nq, heads, head_dim, generator=g))
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    return Case(
        torch.cat(qs),
        k_cache,
        v_cache,
        table,
        cu,
        torch.tensor(seq_lens, dtype=torch.int32),
        keys,
        values,
        max(q_lens),
    )


def dense_reference(case: Case, scale: float, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    outs = []
    for b, n in enumerate(case.seq_lens.tolist()):
        lo, hi = int(case.cu[b]), int(case.cu[b + 1])
        q_pos = torch.arange(n - (hi - lo), n)
        k_pos = torch.arange(n)
        outs.append(
            masked_attention(case.q[lo:hi], case.keys[b], case.values[b], q_pos, k_pos, scale, window, sinks)
        )
    return torch.cat(outs)


def naive_one_query(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: int, window: int | None, sinks: torch.Tensor | None
) -> torch.Tensor:
    """Scalar-loop attention for one query at position p (an independent check of masked_attention)."""
    heads, kv_heads = q.shape[0], k.shape[1]
    out = torch.zeros(heads, v.shape[-1], dtype=torch.float64)
    lo = 0 if window is None else max(0, p - window + 1)
    for h in range(heads):
        kh = h // (heads // kv_heads)
        logits = [float(q[h].double() @ k[j, kh].double()) / math.sqrt(q.shape[-1]) for j in range(lo, p + 1)]
        extra = [float(sinks[h])] if sinks is not None else []
        m = max(logits + extra)
        weights = [math.exp(x - m) for x in logits]
        denom = sum(weights) + sum(math.exp(x - m) for x in extra)
        for w, j in zip(weights, range(lo, p + 1), strict=True):
            out[h] += (w / denom) * v[j, kh].double()
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_masked_attention_matches_scalar_loop(window: int | None, with_sinks: bool) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(12, 4, 8, generator=g)
    k = torch.randn(12, 2, 8, generator=g)
    v = torch.randn(12, 2, 6, generator=g)
    sinks = torch.randn(4, generator=g) * 2 if with_sinks else None
    pos = torch.arange(12)
    out = masked_attention(q, k, v, pos, pos, 8**-0.5, window, sinks)
    for p in (0, 3, 7, 11):
        ref = naive_one_query(q[p], k, v, p, window, sinks)
        torch.testing.assert_close(out[p].double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 7, 16, 21])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_torch_matches_dense(window: int | None, with_sinks: bool) -> None:
    # prefill from scratch, a chunk on top of a cached prefix, and a decode, in one batch
    case = make_case([37, 50, 70], [37, 18, 1], window=window, seed=2)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(3)) if with_sinks else None
    scale = 32**-0.5
    out = paged_attention_torch(
        case.q, case.k_cache, case.v_cache, case.table, case.cu, case.seq_lens, scale, window, sinks
    )
    assert not out.isnan().any()
    ref = dense_reference(case, scale, window, sinks)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # Query blocks smaller than a page and than the window read other page ranges: same result.
    blocked = paged_attention_torch(
        case.q,
        case.k_cache,
        case.v_cache,
        case.table,
        case.cu,
        case.seq_lens,
        scale,
        window,
        sinks,
        q_block=5,
    )
    torch.testing.assert_close(blocked, ref, rtol=1e-5, atol=1e-5)


def test_sinks_take_probability_mass() -> None:
    """A large sink drives the output towards zero; a very negative one changes nothing."""
    case = make_case([20], [20], seed=4)
    args = (case.q, case.k_cache, case.v_cache, case.table, case.cu, case.seq_lens, 32**-0.5, 8)
    plain = paged_attention_torch(*args, None)
    tiny = paged_attention_torch(*args, torch.full((4,), -1e4))
    huge = paged_attention_torch(*args, torch.full((4,), 50.0))
    torch.testing.assert_close(tiny, plain)
    assert huge.abs().max() < 1e-10 * plain.abs().max() + 1e-12


def test_write_kv_places_tokens_at_slots() -> None:
    k_cache = torch.zeros(3, PAGE, 2, 4)
    v_cache = torch.zeros(3, PAGE, 2, 3)
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 3)
    write_kv(k_cache, v_cache, torch.tensor([2 * PAGE + 5, 7]), k, v)
    assert torch.equal(k_cache[2, 5], k[0]) and torch.equal(k_cache[0, 7], k[1])
    assert torch.equal(v_cache[2, 5], v[0]) and torch.equal(v_cache[0, 7], v[1])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2


triton_interpret = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)


def _device() -> str:
    return "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@triton_interpret
@pytest.mark.parametrize(
    ("window", "with_sinks", "head_dim"),
    [(None, False, 32), (9, True, 32), (20, True, 24)],  # 24: head dim padded to 32 and masked
)
def test_triton_prefill_matches_torch(window: int | None, with_sinks: bool, head_dim: int) -> None:
    case = make_case([40, 23], [21, 23], heads=4, kv_heads=2, head_dim=head_dim, window=window, seed=5)
    dev = _device()
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(6)) * 2 if with_sinks else None
    scale = head_dim**-0.5
    ref = paged_attention_torch(
        case.q, case.k_cache, case.v_cache, case.table, case.cu, case.seq_lens, scale, window, sinks
    )
    out = paged_attention(
        case.q.to(dev),
        case.k_cache.to(dev),
        case.v_cache.to(dev),
        case.table.to(dev),
        case.cu.to(dev),
        case.seq_lens.to(dev),
        case.max_q,
        scale,
        window,
        None if sinks is None else sinks.to(dev),
        backend="triton",
    ).cpu()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@triton_interpret
@pytest.mark.parametrize(
    ("window", "with_sinks", "kv_heads"), [(None, False, 1), (11, True, 2), (5, True, 4)]
)
def test_triton_decode_matches_torch(window: int | None, with_sinks: bool, kv_heads: int) -> None:
    # GQA groups of 4, 2 and 1 query heads per KV head (the kernel tiles one group per program)
    case = make_case(
        [1, 17, 45], [1, 1, 1], heads=4, kv_heads=kv_heads, head_dim=32, v_dim=16, window=window, seed=7
    )
    dev = _device()
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(8)) * 2 if with_sinks else None
    scale = 32**-0.5
    ref = paged_attention_torch(
        case.q, case.k_cache, case.v_cache, case.table, case.cu, case.seq_lens, scale, window, sinks
    )
    out = paged_attention(
        case.q.to(dev),
        case.k_cache.to(dev),
        case.v_cache.to(dev),
        case.table.to(dev),
        case.cu.to(dev),
        case.seq_lens.to(dev),
        1,
        scale,
        window,
        None if sinks is None else sinks.to(dev),
        backend="triton",
    ).cpu()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [None, 1, 11, 33])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_batched_torch_decode_matches_per_sequence(window: int | None, with_sinks: bool) -> None:
    case = make_case([1, 17, 45, 64, 33], [1] * 5, heads=6, kv_heads=2, window=window, seed=9)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(10)) if with_sinks else None
    scale = 32**-0.5
    args = (case.k_cache, case.v_cache, case.table)
    loop = paged_attention_torch(case.q, *args, case.cu, case.seq_lens, scale, window, sinks)
    batched = paged_decode_torch(case.q, *args, case.seq_lens, scale, window, sinks)
    assert not batched.isnan().any()
    torch.testing.assert_close(batched, loop, rtol=1e-5, atol=1e-6)
    dispatched = paged_attention(case.q, *args, case.cu, case.seq_lens, 1, scale, window, sinks, "torch")
    assert torch.equal(dispatched, batched)


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 70)), min_size=1, max_size=4),
    window=st.one_of(st.none(), st.integers(1, 40)),
    with_sinks=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_paged_torch_matches_dense_property(
    seqs: list[tuple[int, int]], window: int | None, with_sinks: bool, seed: int
) -> None:
    """Any mix of sequence lengths, chunk sizes and windows: paged == dense over the same keys."""
    seq_lens = [n for n, _ in seqs]
    q_lens = [min(n, q) for n, q in seqs]
    case = make_case(seq_lens, q_lens, heads=4, kv_heads=2, head_dim=8, v_dim=4, window=window, seed=seed)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(seed)) if with_sinks else None
    out = paged_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.table,
        case.cu,
        case.seq_lens,
        case.max_q,
        8**-0.5,
        window,
        sinks,
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out, dense_reference(case, 8**-0.5, window, sinks), rtol=1e-5, atol=1e-5)
