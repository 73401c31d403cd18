"""The C MoE kernel (cpu_moe) against the per-token reference and the torch paths, through both
its AVX2 and its scalar kernels."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from llm_core.backends.moe import CpuMoE
from llm_core.backends.moe_torch import TorchMoE
from llm_core.kernels import c_kernel, cpu_moe
from llm_core.models.moe import Routing, SparseMoE, TopKRouter
from tests.llm_core.conftest import simd_fixture
from tests.llm_core.models.test_decoder_moe import moe_config, per_token_reference

pytestmark = pytest.mark.skipif(not cpu_moe.AVAILABLE, reason="llm_core.kernels._moe is not built")


simd = simd_fixture(cpu_moe)


def random_moe(seed: int, **kw: int) -> SparseMoE:
    moe = SparseMoE(moe_config(**kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    moe.after_load(CpuMoE())  # the C kernels, and the [E, in, out] layout they read
    return moe


@pytest.mark.parametrize("num_tokens", [0, 1, 3, 37, 300])
@pytest.mark.parametrize(
    ("hidden", "inter", "top_k"),
    [(24, 8, 3), (32, 16, 2), (40, 24, 1)],  # widths that are and are not multiples of 16 / 8
)
def test_matches_per_token_reference(
    simd: str, expert_product: str, num_tokens: int, hidden: int, inter: int, top_k: int
) -> None:
    moe = random_moe(1, hidden_size=hidden, moe_intermediate_size=inter, num_experts_per_tok=top_k)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(2))
    routing = moe.gate(x)
    assert cpu_moe.supports(x, moe.experts.gate_up_proj, moe.experts.down_proj)
    out = moe.experts(x, routing)
    torch.testing.assert_close(out, per_token_reference(moe.experts, x, routing), rtol=1e-5, atol=1e-5)
    if num_tokens > 5:  # a token's output does not depend on its batch
        torch.testing.assert_close(
            moe.experts(x[5:6], Routing(routing.experts[5:6], routing.weights[5:6])), out[5:6]
        )


def test_agrees_with_the_torch_path() -> None:
    moe = random_moe(3)
    x = torch.randn(50, 24, generator=torch.Generator().manual_seed(4))
    out = moe(x)
    moe.after_load(TorchMoE())
    torch.testing.assert_close(out, moe(x), rtol=1e-5, atol=1e-6)


def test_needs_the_fused_layout_and_fp32() -> None:
    moe = SparseMoE(moe_config())
    x = torch.randn(4, 24)
    assert not cpu_moe.supports(x, moe.experts.gate_up_proj, moe.experts.down_proj)  # checkpoint layout
    moe.experts.after_load(CpuMoE())
    assert cpu_moe.supports(x, moe.experts.gate_up_proj, moe.experts.down_proj)
    assert not cpu_moe.supports(x.double(), moe.experts.gate_up_proj, moe.experts.down_proj)


def test_an_expert_id_out_of_range_is_an_error() -> None:
    moe = random_moe(5)
    x = torch.randn(3, 24)
    routing = moe.gate(x)
    bad = routing.experts.clone()
    bad[1, 0] = 8  # 8 experts: ids 0..7
    with pytest.raises(ValueError, match="out of range"):
        cpu_moe.moe_experts_cpu(x, bad, routing.weights, moe.experts.gate_up_proj, moe.experts.down_proj)


@pytest.mark.parametrize(
    "kw",
    [
        {},  # 8 experts in 4 groups, top-2 groups, top-3 experts, normalised, scaled by 2.5
        {"n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "norm_topk_prob": False},
        {"n_routed_experts": 16, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 4,
         "routed_scaling_factor": 1.0},
        {"hidden_size": 21},  # not a multiple of 8
    ],
)  # fmt: skip
def test_route_matches_the_torch_router(kw: dict[str, Any]) -> None:
    """Same experts in the same order (descending score + bias) and the same weights as the torch
    TopKRouter, for 300 tokens with a selection bias large enough to change choices."""
    router = TopKRouter(moe_config(**kw))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(router.num_experts, generator=g) * 0.3)
    x = torch.randn(300, router.weight.shape[1], generator=g)
    router.backend = CpuMoE()
    fast = router(x)
    router.backend = TorchMoE()
    ref = router(x)
    assert torch.equal(fast.experts, ref.experts)
    # The router logits are dot products summed in another order than torch's GEMM (which takes
    # AVX-512 kernels on CPUs that have them): a few float32 ulps of each logit, no more.
    torch.testing.assert_close(fast.weights, ref.weights, rtol=4e-6, atol=4e-7)
    assert fast.experts.dtype == torch.int64 and fast.weights.dtype == torch.float32


def test_route_rejects_inconsistent_sizes() -> None:
    x, w, bias = torch.randn(3, 8), torch.randn(6, 8), torch.zeros(6)
    with pytest.raises(ValueError, match="route"):  # 6 experts do not split into 4 groups
        cpu_moe.route(x, w, bias, top_k=2, n_group=4, topk_group=1, norm_topk_prob=True, scaling=1.0)
    with pytest.raises(ValueError, match="route"):  # top-4 of the 3 experts in one group of 3
        cpu_moe.route(x, w, bias, top_k=4, n_group=2, topk_group=1, norm_topk_prob=True, scaling=1.0)
    with pytest.raises(ValueError, match="bias"):
        cpu_moe.route(
            x, w, torch.zeros(5), top_k=2, n_group=1, topk_group=1, norm_topk_prob=True, scaling=1.0
        )


def float64_reference(
    x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gu: torch.Tensor, dn: torch.Tensor
) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * (silu(x gate_e) * (x up_e)) @ down_e in float64, token by token, from
    the [E, in, out] weights (gate columns first): the documented math, no kernel code."""
    inter = dn.shape[1]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(experts.shape[1]):
            e = int(experts[t, k])
            h = x[t].double() @ gu[e].double()
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(weights[t, k]) * (a @ dn[e].double())
    return out


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows", [[1, 0, 0, 2], [15, 16, 0, 17], [0, 64, 3, 0], [300, 1, 0, 0], [4096, 0, 0, 0], [0, 0, 0, 0]]
)
def test_rows_per_expert_from_one_to_thousands_against_float64(
    rows: list[int], weight_dtype: torch.dtype, expert_product: str
) -> None:
    """Expert e gets rows[e] tokens (top-1: experts with none included), from 1 row to a prefill
    chunk's hundreds and 4,096, through each product, and the threshold chosen at import; weights
    stored in float32 or bf16 (the reference takes the bf16 values exactly)."""
    num_experts, hidden, inter = len(rows), 48, 32
    g = torch.Generator().manual_seed(sum(rows) + 7)
    gu = (torch.randn(num_experts, hidden, 2 * inter, generator=g) * 0.2).to(
        weight_dtype
    )  # [E, in, out] memory
    dn = (torch.randn(num_experts, inter, hidden, generator=g) * 0.2).to(weight_dtype)
    experts = torch.tensor([e for e, n in enumerate(rows) for _ in range(n)], dtype=torch.int64)
    experts = experts[torch.randperm(len(experts), generator=g)].reshape(-1, 1)
    x = torch.randn(len(experts), hidden, generator=g)
    weights = torch.rand(len(experts), 1, generator=g) + 0.5
    out = cpu_moe.moe_experts_cpu(x, experts, weights, gu.transpose(1, 2), dn.transpose(1, 2))
    want = float64_reference(x, experts, weights, gu, dn)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    if weight_dtype is torch.bfloat16:  # widened as read: the bits of float32 weights of those values
        same = cpu_moe.moe_experts_cpu(
            x, experts, weights, gu.float().transpose(1, 2), dn.float().transpose(1, 2)
        )
        assert torch.equal(out, same)


def bf16_values(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def bf16_products_reference(
    x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gu: torch.Tensor, dn: torch.Tensor
) -> torch.Tensor:
    """``float64_reference`` as a bf16 model multiplies: x and each activated row rounded to bf16
    before their products, the products and sums in float64."""
    inter = dn.shape[1]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(experts.shape[1]):
            e = int(experts[t, k])
            h = bf16_values(x[t]) @ gu[e].double()
            a = bf16_values(torch.nn.functional.silu(h[:inter]) * h[inter:])
            out[t] += float(weights[t, k]) * (a @ dn[e].double())
    return out


@pytest.fixture(params=["mkl_bf16", "widened"])
def bf16_gemm(request: pytest.FixtureRequest) -> Any:
    """bf16 products of many rows in MKL's bf16 product, then as sgemm over the widened weight."""
    on = request.param == "mkl_bf16"
    if on and not cpu_moe.set_bf16_gemm(True):
        cpu_moe.set_bf16_gemm(c_kernel.bf16_products_default())
        pytest.skip("torch's BLAS has no bf16 product here")
    cpu_moe.set_bf16_gemm(on)
    yield request.param
    cpu_moe.set_bf16_gemm(c_kernel.bf16_products_default())


@pytest.mark.parametrize(
    "rows", [[1, 0, 0, 2], [15, 16, 0, 17], [0, 64, 3, 0], [300, 1, 0, 0], [4096, 0, 0, 0], [0, 0, 0, 0]]
)
def test_bf16_products_from_one_row_to_thousands_against_float64(
    rows: list[int], expert_product: str, bf16_gemm: str
) -> None:
    """bf16 products (bf16 weights, x and the activated rows rounded to bf16, float32 sums), expert
    e given rows[e] tokens, through the small-M product and BLAS (MKL's bf16 product or the widened
    weight): the float64 answer of that math. An activated value the kernel and the reference round
    to neighbouring bf16 values (their float32 and float64 SwiGLU straddling a tie) moves an output
    by a bf16 step of one term (about one activated value in 30,000): every output within 2e-3,
    and all but 1% within float32 rounding."""
    num_experts, hidden, inter = len(rows), 48, 32
    g = torch.Generator().manual_seed(sum(rows) + 9)
    gu = (torch.randn(num_experts, hidden, 2 * inter, generator=g) * 0.2).to(torch.bfloat16)
    dn = (torch.randn(num_experts, inter, hidden, generator=g) * 0.2).to(torch.bfloat16)
    experts = torch.tensor([e for e, n in enumerate(rows) for _ in range(n)], dtype=torch.int64)
    experts = experts[torch.randperm(len(experts), generator=g)].reshape(-1, 1)
    x = torch.randn(len(experts), hidden, generator=g)
    weights = torch.rand(len(experts), 1, generator=g) + 0.5
    args = (x, experts, weights, gu.transpose(1, 2), dn.transpose(1, 2))
    out = cpu_moe.moe_experts_cpu(*args, bf16_inputs=True)
    want = bf16_products_reference(x, experts, weights, gu, dn)
    torch.testing.assert_close(out.double(), want, rtol=2e-3, atol=2e-3)
    if len(experts):
        close = (out.double() - want).abs() <= 1e-5 * (1 + want.abs())
        assert close.double().mean() >= 0.99
        # the inputs really are rounded: float32 inputs give another answer
        assert (cpu_moe.moe_experts_cpu(*args) - out).abs().max() > 1e-4


def mixed_batch(seed: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """x, experts, weights and [E, in, out] gate_up / down weights in ``dtype`` of a batch whose
    experts get 0 to 200 rows, below and above the BLAS threshold."""
    rows = [1, 3, 15, 16, 40, 0, 200, 7]
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(len(rows), 48, 64, generator=g) * 0.2).to(dtype)
    dn = (torch.randn(len(rows), 32, 48, generator=g) * 0.2).to(dtype)
    experts = torch.tensor([e for e, n in enumerate(rows) for _ in range(n)]).reshape(-1, 1)
    x = torch.randn(len(experts), 48, generator=g)
    weights = torch.rand(len(experts), 1, generator=g)
    return x, experts, weights, gu, dn


def test_bf16_products_agree_across_products_to_float32_rounding() -> None:
    """A mixed batch (experts below and above 16 rows) of bf16 products through the small-M
    product, MKL's bf16 product and sgemm over the widened weight: the same math, float32 sums in
    other orders."""
    x, experts, weights, gu, dn = mixed_batch(12, torch.bfloat16)
    before = cpu_moe.blas_min_rows(), cpu_moe.bf16_blas_min_rows()
    outs = []
    try:
        for n, gemm in ((1 << 30, True), (1, True), (1, False), (16, True)):
            cpu_moe.set_blas_min_rows(n, n)
            cpu_moe.set_bf16_gemm(gemm)
            outs.append(
                cpu_moe.moe_experts_cpu(
                    x, experts, weights, gu.transpose(1, 2), dn.transpose(1, 2), bf16_inputs=True
                )
            )
    finally:
        cpu_moe.set_blas_min_rows(*before)
        cpu_moe.set_bf16_gemm(c_kernel.bf16_products_default())
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)


def test_bf16_weights_wider_than_a_widened_block_give_the_float32_bits() -> None:
    """Products of many rows widen a bf16 weight 512 columns at a time (the scratch stays bounded):
    widths across a block boundary (gate_up 600 = 512 + 88 columns, down 530) still give the
    bits of one sgemm over float32 weights of the same values, and the float64 answer."""
    hidden, inter, rows = 530, 300, [40, 0, 17, 0]
    g = torch.Generator().manual_seed(11)
    gu = (torch.randn(len(rows), hidden, 2 * inter, generator=g) * 0.05).to(torch.bfloat16)
    dn = (torch.randn(len(rows), inter, hidden, generator=g) * 0.05).to(torch.bfloat16)
    experts = torch.tensor([[e] for e, n in enumerate(rows) for _ in range(n)], dtype=torch.int64)
    x = torch.randn(len(experts), hidden, generator=g)
    weights = torch.rand(len(experts), 1, generator=g) + 0.5
    before = cpu_moe.blas_min_rows(), cpu_moe.bf16_blas_min_rows()
    cpu_moe.set_blas_min_rows(16, 16)  # both experts through BLAS in either dtype
    try:
        out = cpu_moe.moe_experts_cpu(x, experts, weights, gu.transpose(1, 2), dn.transpose(1, 2))
        same = cpu_moe.moe_experts_cpu(
            x, experts, weights, gu.float().transpose(1, 2), dn.float().transpose(1, 2)
        )
    finally:
        cpu_moe.set_blas_min_rows(*before)
    assert torch.equal(out, same)
    want = float64_reference(x, experts, weights, gu, dn)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def test_both_products_agree_to_float32_rounding() -> None:
    """A mixed batch (experts below and above 16 rows) through the small-M product, BLAS and the
    threshold chosen at import: float32 rounding apart."""
    x, experts, weights, gu, dn = mixed_batch(11, torch.float32)
    before = cpu_moe.blas_min_rows(), cpu_moe.bf16_blas_min_rows()
    outs = []
    try:
        for n in (1 << 30, 1, 16):
            cpu_moe.set_blas_min_rows(n)
            outs.append(cpu_moe.moe_experts_cpu(x, experts, weights, gu.transpose(1, 2), dn.transpose(1, 2)))
    finally:
        cpu_moe.set_blas_min_rows(*before)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hidden", "inter"), [(48, 32), (40, 72), (136, 100)])
def test_avx512_products_give_the_avx2_bits(hidden: int, inter: int, weight_dtype: torch.dtype) -> None:
    """The AVX-512 tiles (several strips wide) run each output's FMA chain over k in the AVX2
    tile's order: the same bits, for 1 to 9 rows per expert, strip counts that leave blocks
    partly filled and widths with columns past the last whole strip."""
    if cpu_moe.simd() != "avx512":
        pytest.skip("this CPU or build has no AVX-512 products")
    rows = [1, 2, 3, 4, 5, 9, 0, 1]
    g = torch.Generator().manual_seed(hidden + inter)
    gu = (torch.randn(len(rows), hidden, 2 * inter, generator=g) * 0.2).to(weight_dtype)
    dn = (torch.randn(len(rows), inter, hidden, generator=g) * 0.2).to(weight_dtype)
    experts = torch.tensor([e for e, n in enumerate(rows) for _ in range(n)]).reshape(-1, 1)
    x = torch.randn(len(experts), hidden, generator=g)
    weights = torch.rand(len(experts), 1, generator=g)
    before = cpu_moe.blas_min_rows(), cpu_moe.bf16_blas_min_rows()
    outs = []
    try:
        cpu_moe.set_blas_min_rows(1 << 30, 1 << 30)  # every expert through the small-M product
        for level in ("avx512", "avx2"):
            cpu_moe.set_simd(level)
            outs.append(cpu_moe.moe_experts_cpu(x, experts, weights, gu.transpose(1, 2), dn.transpose(1, 2)))
    finally:
        cpu_moe.set_simd("avx512")
        cpu_moe.set_blas_min_rows(*before)
    assert torch.equal(outs[0], outs[1])
