"""The planned torch attention path (shared per-step gather plans) against the dense reference.

Pools come from ``test_attention.make_case``: NaN everywhere except the slots the batch owns, pages
scattered, SWA pages outside every window unmapped and poisoned, so a planned gather that reads
one slot too many, or a padding column that is not masked, shows up as NaN or a large error.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core.attention_plan import (
    StepPlan,
    decode_attention,
    kv_rows,
    plan_decode,
    prefill_attention,
    prefill_seqs,
    softmax_with_sinks,
)
from tests.llm_core.test_attention import PAGE, Case, dense_reference, make_case


def new_kv(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's k/v rows [T, Hkv, *] (the last q_len positions of each sequence), packed."""
    ks, vs = [], []
    for b, n in enumerate(case.seq_lens.tolist()):
        nq = int(case.cu[b + 1] - case.cu[b])
        ks.append(case.keys[b][n - nq : n])
        vs.append(case.values[b][n - nq : n])
    return torch.cat(ks), torch.cat(vs)


@pytest.mark.parametrize("window", [None, 1, 11, 33])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_plan_matches_dense(window: int | None, with_sinks: bool) -> None:
    case = make_case([1, 17, 45, 64, 33, 100], [1] * 6, heads=6, kv_heads=2, window=window, seed=3)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(4)) if with_sinks else None
    scale = 32**-0.5
    plan = plan_decode(case.table, case.seq_lens, PAGE, window)
    widest = max(n if window is None else min(n, window) for n in case.seq_lens.tolist())
    assert plan.slots.shape == (6, widest)  # columns start at each window, not at a page boundary
    out = decode_attention(case.q, case.k_cache, case.v_cache, plan, scale, sinks)
    assert not out.isnan().any()
    torch.testing.assert_close(out, dense_reference(case, scale, window, sinks), rtol=1e-5, atol=1e-6)
    shared = decode_attention(case.q, case.k_cache, case.v_cache, plan, scale, sinks, kv_rows(plan, 2))
    assert torch.equal(shared, out)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_softmax_with_sinks_equals_softmax_over_an_extra_column(with_sinks: bool) -> None:
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(3, 4, 5, 9, generator=g) * 4
    scores[0, 0, 0, :] = float("-inf")  # a fully masked row: only the sink takes mass
    scores[1, :, :, 2:5] = float("-inf")
    sinks = torch.randn(4, 1, 1, generator=g) if with_sinks else None
    got = softmax_with_sinks(scores.clone(), sinks)
    if sinks is None:
        torch.testing.assert_close(got[1:], torch.softmax(scores[1:], dim=-1))
        return
    col = sinks.expand(3, 4, 5, 1)
    ref = torch.softmax(torch.cat([scores, col], dim=-1), dim=-1)[..., :-1]
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    assert bool((got[0, 0, 0] == 0).all())


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(1, 70), st.integers(0, 70)), min_size=1, max_size=4),
    window=st.one_of(st.none(), st.integers(1, 40)),
    with_sinks=st.booleans(),
    q_block=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_prefill_plan_matches_dense(
    seqs: list[tuple[int, int]], window: int | None, with_sinks: bool, q_block: int, seed: int
) -> None:
    """Fresh prompts (no cached prefix), chunks after a cached prefix, and mixes of both."""
    q_lens = [q for q, _ in seqs]
    seq_lens = [q + cached for q, cached in seqs]
    case = make_case(seq_lens, q_lens, heads=4, kv_heads=2, window=window, seed=seed)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(seed + 1)) if with_sinks else None
    scale = 32**-0.5
    k_new, v_new = new_kv(case)
    out = prefill_attention(
        case.q,
        k_new,
        v_new,
        case.k_cache,
        case.v_cache,
        case.table,
        prefill_seqs(case.cu, case.seq_lens),
        scale,
        window,
        sinks,
        q_block=q_block,
    )
    assert not out.isnan().any()
    torch.testing.assert_close(out, dense_reference(case, scale, window, sinks), rtol=1e-4, atol=1e-5)


def test_step_plan_builds_each_layer_type_once() -> None:
    full = make_case([20, 50], [1, 1], seed=5)
    case = make_case([20, 50], [1, 1], window=16, seed=5)
    plan = StepPlan({False: full.table, True: case.table}, case.cu, case.seq_lens, 1)
    assert plan.is_decode
    swa = plan.decode(True, PAGE, 16)
    assert plan.decode(True, PAGE, 16) is swa
    assert plan.rows(True, 2) is plan.rows(True, 2)
    assert plan.decode(False, PAGE, None).slots.shape == (2, 50)
    calls: list[int] = []

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return torch.zeros(1), torch.ones(1)

    plan.rope((8, 1e4), make)
    plan.rope((8, 1e4), make)
    plan.rope((8, 5e6), make)
    assert len(calls) == 2
    prefill = StepPlan({False: case.table}, torch.tensor([0, 3, 4]), torch.tensor([20, 50]), 3)
    assert not prefill.is_decode
    assert [s.hi - s.lo for s in prefill.prefill()] == [3, 1]  # one single-token sequence: not split
    assert prefill.decode_rows() is None
    cu, lens = torch.tensor([0, 1, 4, 5, 6]), torch.tensor([20, 9, 50, 33])
    mixed = StepPlan({False: torch.zeros(4, 4, dtype=torch.int32)}, cu, lens, 3)
    assert [(s.lo, s.hi, s.b) for s in mixed.prefill()] == [(1, 4, 1)]
    rows = mixed.decode_rows()
    assert rows is not None and rows.tolist() == [0, 4, 5]
    assert mixed.decode(False, PAGE, None).slots.shape == (3, 50)  # planned over sequences 0, 2, 3
