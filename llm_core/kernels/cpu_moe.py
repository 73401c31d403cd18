"""CPU MoE through the C kernel (``_moe.c``): every routed expert of a layer in one call, and the
router before it in another (``route``: what ``moe.TopKRouter`` computes).

    x [T, H], Routing(experts [T, K], weights [T, K]), gate_up [E, 2I, H], down [E, H, I]
    -> out [T, H] = sum_k weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t])

The kernel reads the weights as [E, in, out] row-major, which is how
the MoE backend's pack hook (``backends.layout.pack_experts``) lays them out in memory (``supports`` checks it). Why a kernel:
with a few tokens per expert (decode), the torch path is small batched GEMMs over padded rows plus
a dozen gather, activation and scatter ops per layer; the kernel streams each expert's weights
once per call (fetching the next routed expert's meanwhile) and fuses the rest; an expert with
many rows (a prefill chunk's; on an Intel CPU any) goes through torch's BLAS on one thread instead
(``BLAS``; ``c_kernel.expert_blas_min_rows``), ~3x faster at 256 rows. x fp32; the expert weights
fp32 or bf16 (widened as read: the bits of fp32 weights of the same values; a bf16 expert takes
BLAS from ``bf16_blas_min_rows``, its weight widened into a per-thread scratch 512 columns at a
time);
``AVAILABLE`` is False when the extension was not built, and ``backends.selector`` chooses the
torch MoE backend.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llm_core.kernels import c_kernel
from llm_core.kernels.c_kernel import buffer as _buf
from llm_core.kernels.weight_layout import in_out_view as _in_out

_kernel = c_kernel.load("llm_core.kernels._moe")
# An expert given many rows multiplies through torch's sgemm (MKL, one thread) when bound
# (``c_kernel.expert_blas_min_rows``), as the decoder-layer kernel's do: the same bits.
BLAS = c_kernel.bind_blas(_kernel)

AVAILABLE = _kernel is not None


def simd() -> str | None:
    """'avx512', 'avx2' or 'scalar' (the products in use), None when not built."""
    return c_kernel.simd(_kernel)


def set_simd(name: str) -> None:
    """Use the 'avx512', 'avx2' or 'scalar' products from now on (see ``c_kernel.set_simd``)."""
    c_kernel.set_simd(_kernel, name)


def blas_min_rows() -> int:
    """Rows from which an expert multiplies through BLAS (a large number: never)."""
    return _blas_min_rows[0]


def bf16_blas_min_rows() -> int:
    """The same for bf16 expert weights."""
    return _blas_min_rows[1]


def set_blas_min_rows(n: int, bf16: int | None = None) -> None:
    """Experts with n rows or more (``bf16`` rows with bf16 weights; default:
    ``c_kernel.blas_thresholds``) multiply through BLAS from now on, in this kernel and the
    decoder-layer kernel alike (``c_kernel.expert_blas_min_rows`` at import; tests run both
    products this way)."""
    global _blas_min_rows
    from llm_core.kernels import cpu_layer

    both = c_kernel.blas_thresholds(n, bf16)
    if _kernel is not None:
        _kernel.set_blas_min_rows(*both)
    if cpu_layer.AVAILABLE:
        cpu_layer.set_blas_min_rows(*both)
    _blas_min_rows = both


_blas_min_rows = c_kernel.blas_thresholds(c_kernel.expert_blas_min_rows())  # as bind_blas set them


def set_bf16_gemm(on: bool) -> bool:
    """bf16 products of many rows (``moe_experts_cpu(bf16_inputs=True)``, the decoder-layer kernel's
    ``set_bf16_products``) run in MKL's bf16 product (``on``) or as sgemm over the widened weight
    from now on, in this kernel and the decoder-layer kernel alike (the same math; chosen at
    import by ``c_kernel.bf16_products_default``). Returns whether MKL's product is bound."""
    from llm_core.kernels import cpu_layer

    bound = bool(_kernel.set_bf16_gemm(on)) if _kernel is not None else False
    if cpu_layer.AVAILABLE:
        bound = cpu_layer.set_bf16_gemm(on)
    return bound


def supports(x: Tensor, gate_up: Tensor, down: Tensor) -> bool:
    """True when the kernel can run these tensors: built, CPU, x fp32, weights fp32 or bf16 (both
    the same) laid out [E, in, out]."""
    return (
        _kernel is not None
        and x.device.type == gate_up.device.type == down.device.type == "cpu"
        and x.dtype == torch.float32
        and gate_up.dtype == down.dtype
        and gate_up.dtype in (torch.float32, torch.bfloat16)
        and _in_out(gate_up) is not None
        and _in_out(down) is not None
    )


def moe_experts_cpu(
    x: Tensor, experts: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, bf16_inputs: bool = False
) -> Tensor:
    """x [T, H] routed to ``experts`` [T, K] with ``weights`` [T, K] -> [T, H] fp32 (module doc).

    gate_up [E, 2I, H] and down [E, H, I] as ``GroupedExperts`` holds them after ``after_load``.
    ``bf16_inputs`` with bf16 weights: bf16 products (``cpu_layer``'s module doc), x and each
    expert's activated rows rounded to bf16 before their products. Raises RuntimeError when the
    kernel cannot run them, ValueError for an expert id out of range."""
    if _kernel is None or not supports(x, gate_up, down):
        raise RuntimeError(
            "moe_experts_cpu needs the built kernel, fp32 CPU x and fp32/bf16 [E, in, out] weights"
        )
    gu, dn = _in_out(gate_up), _in_out(down)
    assert gu is not None and dn is not None
    num_tokens, hidden = x.shape
    top_k = experts.shape[1]
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    assert down.shape == (num_experts, hidden, inter), (gate_up.shape, down.shape)
    out = x.new_empty(num_tokens, hidden)
    bf16_inputs = bf16_inputs and gu.dtype is torch.bfloat16
    _kernel.moe_experts(
        _buf(x.to(torch.bfloat16).to(torch.float32) if bf16_inputs else x),
        _buf(experts.to(torch.int64)),
        _buf(weights.to(torch.float32)),
        _buf(gu),
        _buf(dn),
        out.numpy(),
        num_tokens,
        top_k,
        num_experts,
        hidden,
        inter,
        gu.dtype is torch.bfloat16,
        bf16_inputs,
    )
    return out


def supports_route(x: Tensor, weight: Tensor) -> bool:
    """True when ``route`` can run these tensors (built, CPU, fp32)."""
    return (
        _kernel is not None
        and x.device.type == weight.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
    )


def route(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[Tensor, Tensor]:
    """Sigmoid routing of x [T, H] by the router weight [E, H] -> (experts int64 [T, K], weights fp32 [T, K]).

    What ``moe.TopKRouter`` computes (scores, selection bias, group-limited top-k, normalised and
    scaled weights) in one call; experts come in descending order of score + bias, ties to the
    lower expert id. Raises ValueError for inconsistent sizes."""
    if _kernel is None or not supports_route(x, weight):
        raise RuntimeError("route needs the built kernel and fp32 CPU tensors")
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    experts = torch.empty(num_tokens, top_k, dtype=torch.int64)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
    _kernel.route(
        _buf(x),
        _buf(weight),
        _buf(bias.to(torch.float32)),
        experts.numpy(),
        weights.numpy(),
        num_tokens,
        hidden,
        num_experts,
        top_k,
        n_group,
        topk_group,
        norm_topk_prob,
        float(scaling),
    )
    return experts, weights
