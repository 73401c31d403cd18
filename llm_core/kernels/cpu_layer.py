"""A whole decoder layer per C call on CPU (``_decoder_layer.c``), for the model's paged forward.

    residual += x;  h = norm1(residual)
    residual += attention(h) @ Wo          (qkv projection, rotary, KV store, paged attention)
    x = mlp(norm2(residual))               (dense SwiGLU, or router + routed experts)

``x`` and ``residual`` are updated in place, so a forward keeps two [T, hidden] buffers for all its
layers. Why: in a decode step of a small model the Python and torch work between the per-op
kernels (module calls, argument checks and buffer exports, small allocations: ~15 operations per
layer) costs as much as some kernels. The pieces are the per-op kernels' code (``cpu_attention``,
``cpu_moe``, ``cpu_norm``). Projections of more than ``PACKED_MAX_ROWS`` rows (prefill) call the
BLAS routine torch's own CPU linear calls (``sgemm_`` from libtorch_cpu) the same way, so a MoE
layer then gives the same bits as the per-op path; smaller batches (decode) multiply by
strip-packed copies of the attention and dense-MLP projection weights (``pack_strips``; BLAS
repacks a weight on every call, which at 32 rows costs about as much as the product), which agree
to float32 rounding. The dense layer's activation is the MoE kernel's SwiGLU (float32 rounding
from torch's silu). The packed copies add the attention and dense-MLP projections' size in memory
once more; the routed experts (most of a MoE model) are not copied.

With several threads (``set_threads``; the model passes torch's intra-op thread count) a layer's
attention is split by query rows (a long prompt's too), its routed experts by expert, its
projections by column strip (a prefill's as single-threaded BLAS calls on the layer's threads:
MKL's own OpenMP threads spin after each call and slowed the layer's next work on two cores), and
a prefill's norms and router by rows, with the same bits for any count.

Activations, sums, norms and router run in float32. The projection and expert weights may be
stored in float32 or bfloat16 (``STORAGE_DTYPES``), and so may the KV pools; new keys and values
are rounded to bf16 as ``.to(torch.bfloat16)`` rounds. bf16 weights run one of two ways
(``set_bf16_products``, chosen at import by ``c_kernel.bf16_products_default``):

- bf16 products (where MKL's bf16 product has AVX512-BF16 or AMX under it): every product's input
  rows are rounded to bf16 (the normed rows, which the router also reads, the attention output,
  the activated MLP rows), as a bf16 model's activations are, and sums stay float32. A
  prefill-sized product runs in MKL's bf16 x bf16 -> float32 product (about twice sgemm's FLOPs);
  a decode-sized one is the strip product over those rounded rows: the same math, float32 sums in
  another order.
- float32 inputs (elsewhere): a bf16 value is widened to float32 as it is read (exact), so bf16
  weights give the bits of float32 weights holding the same values. A prefill-sized product
  widens its bf16 weight into a per-thread scratch 512 columns at a time, each block one sgemm
  into its columns of the output (every output still sums its products in one call).

CPU only, projection weights input-major (``weight_layout``). ``AVAILABLE`` is False when the
extension was not built or torch's sgemm could not be bound; ``backends.selector`` then chooses no
layer backend and the model runs its modules. ``backends.layer.CpuLayer`` is the caller.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from llm_core.kernels import c_kernel
from llm_core.kernels.attention_batch import AttentionBatch, LayerKVLike
from llm_core.kernels.c_kernel import buffer as _buf
from llm_core.kernels.c_kernel import raw
from llm_core.kernels.weight_layout import in_out_view

_kernel = c_kernel.load("llm_core.kernels._decoder_layer")


BUILT = _kernel is not None  # the extension loaded (AVAILABLE also needs torch's sgemm bound)
AVAILABLE = c_kernel.bind_blas(_kernel)

# Batches of at most this many rows use the strip-packed weight copies (``pack_strips``), larger
# ones torch's sgemm (whose results the modules give bit for bit).
PACKED_MAX_ROWS: int = _kernel.PACKED_MAX_ROWS if _kernel is not None else 0


def set_threads(n: int) -> int:
    """Split each layer's attention (by query rows), routed experts (by expert) and decode-sized
    projections (by column strip) over n threads, the caller included; returns the count in use.
    Every count gives the same bits. The model sets torch's intra-op thread count per forward."""
    assert _kernel is not None
    return int(_kernel.set_threads(n))


def set_bf16_products(on: bool) -> None:
    """With bf16 weights, round every product's input rows to bf16 from now on (``on``; module
    doc). Chosen at import (``c_kernel.bf16_products_default``); this exists for tests of both.
    Which product multiplies many rows then: ``cpu_moe.set_bf16_gemm``."""
    assert _kernel is not None
    global _bf16_products
    _bf16_products = on
    _kernel.set_bf16_products(on)


def bf16_products() -> bool:
    """Whether bf16 weights run as bf16 products (``set_bf16_products``)."""
    return _bf16_products


_bf16_products = False
if AVAILABLE:
    set_bf16_products(c_kernel.bf16_products_default())


def set_bf16_gemm(on: bool) -> bool:
    """Multiply many rows of bf16 products in MKL's bf16 product (``on``) or as sgemm over the
    widened weight; returns whether MKL's is bound (``cpu_moe.set_bf16_gemm`` sets both kernels)."""
    assert _kernel is not None
    return bool(_kernel.set_bf16_gemm(on))


def set_blas_min_rows(n: int, bf16: int) -> None:
    """Routed experts with n rows or more (``bf16`` with bf16 weights) multiply through BLAS
    (``cpu_moe.set_blas_min_rows`` sets both kernels)."""
    assert _kernel is not None
    _kernel.set_blas_min_rows(n, bf16)


def profile(on: bool) -> None:
    """Add up the wall time of each layer phase (``phase_seconds``) from now on, or stop. Off by
    default; on, a layer reads the clock once per phase (``bench.step_profile``)."""
    assert _kernel is not None
    _kernel.profile(on)


def phase_seconds(reset: bool = False) -> dict[str, float]:
    """Seconds per layer phase (norms, qkv_proj, attention, o_proj, router, routed_experts,
    dense_mlp) summed over every layer call while ``profile`` was on; ``reset`` zeroes the sums."""
    assert _kernel is not None
    return dict(_kernel.phase_seconds(reset))


class LayerWeights(NamedTuple):
    """One layer's weights as the kernel takes them (``layer_weights``): views of the weights'
    memory and strip-packed copies, made by the layer backend's pack hook, which runs again after
    any change of the weights (``backends.layer``)."""

    args: tuple[object, ...]  # everything after the step and pool arguments


class MlpArgs(NamedTuple):
    """A layer's MLP as the kernel takes it (``dense_mlp_args`` / ``moe_args``)."""

    args: tuple[object, ...]
    packed: tuple[object, object]  # strip-packed gate_up and down (dense only), or empty
    dtype: torch.dtype  # the weights' storage dtype


# The dtypes the kernel reads weights and KV pools in (module doc).
STORAGE_DTYPES = (torch.float32, torch.bfloat16)


def _in_out(w: Tensor) -> Tensor | None:
    """The [..., in, out] memory of an input-major CPU weight in a storage dtype, or None."""
    if w.device.type != "cpu" or w.dtype not in STORAGE_DTYPES:
        return None
    return in_out_view(w.detach())


def pack_strips(w: Tensor) -> object:
    """A copy of an [in, out] weight as 16-column strips, [out / 16, in, 16] contiguous, in w's
    dtype: what the kernel multiplies small batches (decode) by; empty when out is not a multiple
    of 16."""
    k, n = w.shape
    if n % 16:
        return b""
    return raw(w.reshape(k, n // 16, 16).permute(1, 0, 2).contiguous())


def _fp32(t: Tensor) -> object:
    """A small parameter (norm, router, bias, sinks) as a float32 kernel buffer."""
    return _buf(t.to(torch.float32))


def dense_mlp_args(gate_up: Tensor, down: Tensor) -> MlpArgs | None:
    """The MLP arguments of a dense SwiGLU layer: gate_up [2I, hidden] (gate rows first) and down
    [hidden, I], both input-major; None when they are not."""
    gu, dn = _in_out(gate_up), _in_out(down)
    if gu is None or dn is None or gu.dtype != dn.dtype:
        return None
    return MlpArgs(
        (raw(gu), raw(dn), b"", b"", 0, down.shape[1], 0, 1, 1, False, 1.0),
        (pack_strips(gu), pack_strips(dn)),
        gu.dtype,
    )


def moe_args(
    router: Tensor,
    bias: Tensor,
    gate_up: Tensor,
    down: Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> MlpArgs | None:
    """The MLP arguments of a MoE layer: router [E, hidden] and its selection bias [E] (given to
    the kernel in float32), experts gate_up [E, 2I, hidden] and down [E, hidden, I] input-major;
    None when not so."""
    gu, dn = _in_out(gate_up), _in_out(down)
    if gu is None or dn is None or gu.dtype != dn.dtype or router.device.type != "cpu":
        return None
    args = (
        raw(gu),
        raw(dn),
        _fp32(router),
        _fp32(bias),
        gate_up.shape[0],
        down.shape[2],
        top_k,
        n_group,
        topk_group,
        norm_topk_prob,
        float(scaling),
    )
    return MlpArgs(args, (b"", b""), gu.dtype)


def layer_weights(
    ln1: Tensor,
    ln2: Tensor,
    eps: float,
    qkv_weight: Tensor,
    qkv_bias: Tensor | None,
    o_weight: Tensor,
    sinks: Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int,
    window: int | None,
    scale: float,
    v_scale: float,
    mlp: MlpArgs,
) -> LayerWeights | None:
    """A layer's arguments (norm weights, fused qkv [(H + 2 Hkv') * ., hidden] and o [hidden, H * Dv]
    projections input-major, attention sizes, and ``dense_mlp_args`` / ``moe_args``), with
    strip-packed copies of the projections for small batches; None when the kernel cannot run them
    (the projections and the MLP must share one storage dtype)."""
    qkv, o = _in_out(qkv_weight), _in_out(o_weight)
    if not AVAILABLE or qkv is None or o is None or not qkv.dtype == o.dtype == mlp.dtype:
        return None
    args = (
        _fp32(ln1),
        _fp32(ln2),
        float(eps),
        raw(qkv),
        b"" if qkv_bias is None else _fp32(qkv_bias),
        raw(o),
        b"" if sinks is None else _fp32(sinks),
        num_heads,
        num_kv_heads,
        head_dim,
        v_head_dim,
        0 if window is None else int(window),
        float(scale),
        float(v_scale),
        *mlp.args,
        pack_strips(qkv),
        pack_strips(o),
        *mlp.packed,
        qkv.dtype is torch.bfloat16,
    )
    return LayerWeights(args)


def _view(t: Tensor, dtype: torch.dtype) -> object:
    """A tensor's memory as a kernel buffer, converted to ``dtype`` and made contiguous only when it
    is not already (``c_kernel.buffer`` pays for a detach and a no-op conversion every call)."""
    if t.dtype is dtype and t.is_contiguous() and not t.requires_grad:
        return t.numpy()
    return _buf(t.to(dtype))


class StepArgs:
    """One forward's attention metadata as kernel buffers, per KV group (made once, used by all
    layers), and the buffers of the tensors its layers share (hidden state, rotary tables), each
    exported once per step."""

    def __init__(self, batch: AttentionBatch) -> None:
        cu, lens = _view(batch.cu_seqlens_q, torch.int32), _view(batch.seq_lens, torch.int32)

        def pool(slots: Tensor, table: Tensor) -> tuple[object, ...]:
            return _view(slots, torch.int64), _view(table, torch.int32), cu, lens

        # per layer view, as the batch's tables: a layer takes its view's (``LayerKVLike.group``)
        self.groups = tuple(pool(s, t) for s, t in zip(batch.slots, batch.page_tables, strict=True))
        # tensor -> its buffer; holding the tensor keeps its memory (and identity) for the step
        self._buffers: dict[Tensor, object] = {}

    def buffer(self, t: Tensor, writable: bool = False) -> object:
        """``t``'s kernel buffer (float32 contiguous), exported on first use in this step; ``writable``:
        the kernel updates it in place, so it must be ``t``'s own memory (``numpy()``)."""
        got = self._buffers.get(t)
        if got is None:
            got = self._buffers[t] = t.numpy() if writable else _view(t, torch.float32)
        return got


def decoder_layer_cpu(
    weights: LayerWeights,
    step: StepArgs,
    kv: LayerKVLike,
    cos: Tensor,
    sin: Tensor,
    x: Tensor,
    residual: Tensor,
    first: bool,
) -> None:
    """Run one layer in place on x and residual [T, hidden] (contiguous fp32; module doc). ``first``:
    the residual stream starts here (residual = x). cos/sin [T, rotary width] of this layer's
    rotary. The KV pools are float32 or bf16. Raises ValueError for inconsistent sizes, a write
    slot outside the pool or a page a query reads that is not in it (x and residual are then partly
    updated)."""
    assert _kernel is not None
    if kv.k.dtype not in STORAGE_DTYPES or kv.v.dtype != kv.k.dtype:
        raise ValueError(
            f"decoder_layer: KV pools of {kv.k.dtype} / {kv.v.dtype}; float32 or bf16, both alike"
        )
    _kernel.decoder_layer(
        step.buffer(x, writable=True),
        step.buffer(residual, writable=True),
        first,
        step.buffer(cos),
        step.buffer(sin),
        *step.groups[kv.group],
        raw(kv.k),
        raw(kv.v),
        kv.k.shape[1],
        kv.k.dtype is torch.bfloat16,
        *weights.args,
    )
