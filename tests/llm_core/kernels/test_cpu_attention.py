"""The C paged-attention kernel (cpu_attention) against the dense reference, through both its
AVX2 and its scalar primitives, on pools poisoned with NaN outside what the batch owns (see
test_attention.make_case): a slot read too many, a mis-mapped page or a window off by one shows
up as NaN or a large error."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_core.kernels import cpu_attention
from llm_core.kernels.attention import paged_attention, write_kv
from llm_core.models.rope import PartialRotary, apply_partial_rotary_
from tests.llm_core.conftest import simd_fixture
from tests.llm_core.kernels.test_attention import PAGE, Case, dense_reference, make_case

pytestmark = pytest.mark.skipif(
    not cpu_attention.AVAILABLE, reason="llm_core.kernels._paged_attention is not built"
)

simd = simd_fixture(cpu_attention)


def run(case: Case, scale: float, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    return cpu_attention.paged_attention_cpu(
        case.q, case.k_cache, case.v_cache, case.table, case.cu, case.seq_lens, scale, window, sinks
    )


@pytest.mark.parametrize("window", [None, 1, 7, 16, 21, 128])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "v_dim"),
    [(4, 2, 32, 16), (8, 4, 64, 32), (4, 1, 24, 12), (6, 6, 8, 40)],  # 24/12/40: tails past 8 lanes
)
def test_matches_dense(
    simd: str, window: int | None, with_sinks: bool, heads: int, kv_heads: int, head_dim: int, v_dim: int
) -> None:
    # from scratch, a chunk on a cached prefix, decodes, and a 300-token sequence (several key
    # blocks, so the running softmax max is rescaled)
    case = make_case(
        [37, 50, 70, 3, 300],
        [37, 18, 1, 1, 150],
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        v_dim=v_dim,
        window=window,
        seed=2,
    )
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(3)) * 2 if with_sinks else None
    out = run(case, head_dim**-0.5, window, sinks)
    assert not out.isnan().any()
    ref = dense_reference(case, head_dim**-0.5, window, sinks)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=2e-6)


def test_sequences_without_new_tokens_are_skipped(simd: str) -> None:
    """A zero-length entry in cu_seqlens_q (between others) is skipped; the rest are unaffected."""
    case = make_case([20, 33, 9], [1, 5, 9], window=8, seed=4)
    cu = torch.tensor([0, 1, 1, 6, 15], dtype=torch.int32)  # sequence 1 of 4 contributes nothing
    lens = torch.tensor([20, 12, 33, 9], dtype=torch.int32)
    table = torch.cat([case.table[:1], torch.full_like(case.table[:1], -1), case.table[1:]])
    out = cpu_attention.paged_attention_cpu(
        case.q, case.k_cache, case.v_cache, table, cu, lens, 32**-0.5, 8, None
    )
    torch.testing.assert_close(out, dense_reference(case, 32**-0.5, 8, None), rtol=1e-5, atol=2e-6)


def test_dispatch_picks_the_kernel_for_fp32_cpu() -> None:
    case = make_case([40, 9], [40, 1], seed=5)
    args = (case.q, case.k_cache, case.v_cache, case.table, case.cu, case.seq_lens, case.max_q, 0.2, 8)
    assert torch.equal(paged_attention(*args), paged_attention(*args, backend="cpu"))
    torch.testing.assert_close(paged_attention(*args), paged_attention(*args, backend="torch"))
    assert not cpu_attention.supports(case.q.double(), case.k_cache.double(), case.v_cache.double())


def test_a_page_outside_the_pool_is_an_error_not_a_read() -> None:
    case = make_case([40], [1], window=None, seed=6)
    k_before, v_before = case.k_cache.clone(), case.v_cache.clone()
    for bad in (-1, case.k_cache.shape[0]):
        table = case.table.clone()
        table[0, 1] = bad  # positions 16..31: every query of this sequence reads them
        with pytest.raises(ValueError, match="not in the pool"):
            cpu_attention.paged_attention_cpu(
                case.q, case.k_cache, case.v_cache, table, case.cu, case.seq_lens, 0.2, None, None
            )
    # a window that starts past the unmapped page never reads it
    table = case.table.clone()
    table[0, 0] = -1
    out = cpu_attention.paged_attention_cpu(
        case.q, case.k_cache, case.v_cache, table, case.cu, case.seq_lens, 0.2, 20, None
    )
    assert not out.isnan().any()
    assert torch.equal(case.k_cache.nan_to_num(), k_before.nan_to_num())
    assert torch.equal(case.v_cache.nan_to_num(), v_before.nan_to_num())


def test_inconsistent_shapes_are_rejected() -> None:
    case = make_case([20], [4], seed=7)
    with pytest.raises(ValueError, match="new tokens"):  # 30 new tokens of a 20-token sequence
        cpu_attention.paged_attention_cpu(
            case.q, case.k_cache, case.v_cache, case.table, torch.tensor([0, 30]), case.seq_lens, 0.2
        )
    with pytest.raises(ValueError, match="q has"):  # cu says 3 rows, q has 4
        cpu_attention.paged_attention_cpu(
            case.q, case.k_cache, case.v_cache, case.table, torch.tensor([0, 3]), case.seq_lens, 0.2
        )
    with pytest.raises(RuntimeError, match="fp32"):
        cpu_attention.paged_attention_cpu(
            case.q.double(), case.k_cache, case.v_cache, case.table, case.cu, case.seq_lens, 0.2
        )


@settings(max_examples=30, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(1, 200), st.integers(1, 70)), min_size=1, max_size=5),
    window=st.one_of(st.none(), st.integers(1, 150)),
    with_sinks=st.booleans(),
    group=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_matches_dense_property(
    seqs: list[tuple[int, int]], window: int | None, with_sinks: bool, group: int, seed: int
) -> None:
    """Any mix of lengths, chunks, windows and GQA groups: kernel == dense over the same keys."""
    seq_lens = [n for n, _ in seqs]
    q_lens = [min(n, q) for n, q in seqs]
    heads = 4
    case = make_case(
        seq_lens, q_lens, heads=heads, kv_heads=heads // group, head_dim=16, v_dim=8, window=window, seed=seed
    )
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed)) if with_sinks else None
    out = run(case, 0.25, window, sinks)
    assert not out.isnan().any()
    torch.testing.assert_close(out, dense_reference(case, 0.25, window, sinks), rtol=1e-5, atol=2e-6)


def fused_inputs(
    case: Case, rope_dim: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random projection rows qkv [T, (H + Hkv) * D + Hkv * Dv] for the case's new tokens, their
    rotary tables and their write slots (from the case's page table)."""
    heads, head_dim = case.q.shape[1], case.q.shape[2]
    kv_heads, v_dim = case.k_cache.shape[2], case.v_cache.shape[3]
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(case.q.shape[0], (heads + kv_heads) * head_dim + kv_heads * v_dim, generator=g)
    positions, slots = [], []
    for b, n in enumerate(case.seq_lens.tolist()):
        for pos in range(n - int(case.cu[b + 1] - case.cu[b]), n):
            positions.append(pos)
            slots.append(int(case.table[b, pos // PAGE]) * PAGE + pos % PAGE)
    cos, sin = PartialRotary(rope_dim, 10_000.0).cos_sin(torch.tensor(positions), torch.float32)
    return qkv, cos, sin, torch.tensor(slots)


@pytest.mark.parametrize(("window", "rope_dim"), [(None, 10), (8, 21), (128, 32)])
def test_fused_qkv_equals_rotary_write_then_attend(simd: str, window: int | None, rope_dim: int) -> None:
    """qkv_attention_cpu = apply_partial_rotary_ + write_kv (values scaled) + paged_attention_cpu:
    the same bits in the pools and in the rotated rows, and the same output."""
    heads, kv_heads, head_dim, v_dim, v_scale = 8, 4, 32, 16, 0.707
    case = make_case([37, 50, 3, 90], [37, 18, 1, 1], heads, kv_heads, head_dim, v_dim, window, seed=9)
    qkv, cos, sin, slots = fused_inputs(case, rope_dim, seed=10)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(11))
    k_ref, v_ref, rows = case.k_cache.clone(), case.v_cache.clone(), qkv.clone()
    split = (heads + kv_heads) * head_dim
    qk = apply_partial_rotary_(rows[:, :split].view(-1, heads + kv_heads, head_dim), cos, sin)
    write_kv(k_ref, v_ref, slots, qk[:, heads:], rows[:, split:].reshape(-1, kv_heads, v_dim) * v_scale)
    ref = cpu_attention.paged_attention_cpu(
        qk[:, :heads].contiguous(), k_ref, v_ref, case.table, case.cu, case.seq_lens, 0.3, window, sinks
    )
    out = cpu_attention.qkv_attention_cpu(
        qkv, cos, sin, slots, case.k_cache, case.v_cache, case.table, case.cu, case.seq_lens,
        heads, 0.3, window, sinks, v_scale,
    )  # fmt: skip
    exact = {"rtol": 0.0, "atol": 0.0, "equal_nan": True}
    torch.testing.assert_close(qkv[:, :split], rows[:, :split], **exact)
    torch.testing.assert_close(case.k_cache, k_ref, **exact)
    torch.testing.assert_close(case.v_cache, v_ref, **exact)
    torch.testing.assert_close(out, ref, **exact)


def test_fused_write_outside_the_pool_is_an_error_and_changes_nothing() -> None:
    case = make_case([20, 9], [4, 9], seed=12)
    qkv, cos, sin, slots = fused_inputs(case, 10, seed=13)
    slots[-1] = case.k_cache.shape[0] * PAGE  # one past the last slot
    before = (qkv.clone(), case.k_cache.clone(), case.v_cache.clone())
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_attention.qkv_attention_cpu(
            qkv, cos, sin, slots, case.k_cache, case.v_cache, case.table, case.cu, case.seq_lens, 4, 0.3
        )
    for a, b in zip(before, (qkv, case.k_cache, case.v_cache), strict=True):
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.0, equal_nan=True)
    with pytest.raises(ValueError, match="rotary width"):  # odd width
        cpu_attention.qkv_attention_cpu(
            qkv, cos[:, :9].contiguous(), sin[:, :9].contiguous(), slots.clamp(max=0), case.k_cache,
            case.v_cache, case.table, case.cu, case.seq_lens, 4, 0.3,
        )  # fmt: skip
