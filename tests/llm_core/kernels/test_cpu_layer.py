"""The one-call CPU decoder layer (``cpu_layer`` / ``_decoder_layer.c``) against the module path.

Each layer of the tiny checkpoint's model runs both ways on the same input and a copy of the same
pools: the MoE layers must give the same bits (same kernels, same BLAS call), the dense first layer
the same to float32 rounding (its activation is the C SwiGLU, not torch's silu), and both must
store the same KV. Then the whole paged forward both ways, when the model falls back to its
modules, and the errors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from llm_core.backends.selector import select_backends
from llm_core.caches.kv_pool import PagedKVCache
from llm_core.kernels import c_kernel, cpu_layer, cpu_moe
from llm_core.kernels.attention_batch import AttentionBatch, build_attention_batch
from llm_core.models.checkpoint import LoadedLLM, load_llm
from llm_core.models.config import DecoderConfig
from llm_core.models.decoder import DecoderForCausalLM
from llm_core.models.module_block import MODULES
from llm_core.models.moe import DenseMLP, SparseMoE
from tests.llm_core.conftest import build_tiny_mimo
from tests.llm_core.models.test_decoder import (
    PAGE,
    PagedSeq,
    cpu_backends,
    free_lists,
    make_kv,
    model_with_qkv_bias,
    prompt,
    rel_err,
    step,
)

pytestmark = pytest.mark.skipif(
    not cpu_layer.AVAILABLE, reason="llm_core.kernels._decoder_layer is not built"
)


def zeroed_kv(config: DecoderConfig, num_pages: int, dtype: torch.dtype = torch.float32) -> PagedKVCache:
    kv = make_kv(config, num_pages, dtype)  # NaN-poisoned; zero it so that pools compare with torch.equal
    for i in range(kv.num_layers):
        kv.layer(i).k.zero_()
        kv.layer(i).v.zero_()
    return kv


def prefill_then_decode_batch(lens: list[int], news: list[int]) -> AttentionBatch:
    """Two sequences, pages from shuffled free lists (a decode step after a prefill when news < lens)."""
    full, swa = free_lists(16, seed=3)
    pages = [[full.pop() for _ in range(-(-n // PAGE))] for n in lens]
    swa_pages: list[list[int | None]] = [[swa.pop() for _ in range(-(-n // PAGE))] for n in lens]
    return build_attention_batch(lens, news, [pages, swa_pages], PAGE)


def run_layer_both_ways(
    model: DecoderForCausalLM, i: int, batch: AttentionBatch, seed: int
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """(x, residual, k pool, v pool) after layer i through the modules and through the kernel."""
    layer, config = model.model.layers[i], model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch.num_tokens, config.hidden_size, generator=g)
    residual = torch.randn(batch.num_tokens, config.hidden_size, generator=g)
    positions = batch.positions()
    first = i == 0
    kv_modules, kv_kernel = zeroed_kv(config, 16), zeroed_kv(config, 16)
    weights = layer.block  # what the CPU layer backend took the layer with
    assert isinstance(weights, cpu_layer.LayerWeights)
    # the layer's modules, through the CPU attention, MoE and norm backends
    out, res = MODULES.forward(
        layer.module_block(),
        MODULES.begin(batch),
        kv_modules.layer(i),
        *layer.self_attn._cos_sin(positions, torch.float32, {}),
        x,
        None if first else residual,
    )
    xk, rk = x.clone(), residual.clone()
    cos, sin = layer.self_attn._cos_sin(positions, torch.float32, {})
    cpu_layer.decoder_layer_cpu(
        weights, cpu_layer.StepArgs(batch), kv_kernel.layer(i), cos, sin, xk, rk, first
    )
    return (
        (out, res, kv_modules.layer(i).k, kv_modules.layer(i).v),
        (xk, rk, kv_kernel.layer(i).k, kv_kernel.layer(i).v),
    )


def test_each_layer_equals_the_modules_in_prefill(loaded: LoadedLLM, expert_product: str) -> None:
    """More rows than PACKED_MAX_ROWS: every projection goes through torch's sgemm, as in the modules."""
    batch = prefill_then_decode_batch([40, 33], [40, 33])
    assert batch.num_tokens > cpu_layer.PACKED_MAX_ROWS
    for i, layer in enumerate(loaded.model.model.layers):
        (out, res, k, v), (xk, rk, kk, vk) = run_layer_both_ways(loaded.model, i, batch, seed=i)
        assert torch.equal(rk, res), f"layer {i}: residual"
        assert torch.equal(kk, k) and torch.equal(vk, v), f"layer {i}: stored KV"
        if isinstance(layer.mlp, SparseMoE):
            assert torch.equal(xk, out), f"layer {i}: MoE output"
        else:
            assert rel_err(xk, out) <= 1e-6, f"layer {i}: dense MLP output"


def test_each_layer_equals_the_modules_in_decode(loaded: LoadedLLM, expert_product: str) -> None:
    """A decode step: the projections multiply by the strip-packed copies (their own summation
    order), so everything agrees to float32 rounding."""
    batch = prefill_then_decode_batch([40, 33], [1, 1])
    for i in range(len(loaded.model.model.layers)):
        (out, res, k, v), (xk, rk, kk, vk) = run_layer_both_ways(loaded.model, i, batch, seed=i)
        for name, a, b in (("residual", rk, res), ("output", xk, out), ("k", kk, k), ("v", vk, v)):
            assert rel_err(a, b) <= 1e-6, f"layer {i}: {name}"


@pytest.mark.parametrize(
    ("lens", "news"),
    [([40, 33, 21], [40, 33, 21]), ([40, 33, 21], [1, 1, 1]), ([90], [90]), ([90, 5], [50, 1])],
)
def test_threads_give_the_same_bits(
    loaded: LoadedLLM, lens: list[int], news: list[int], expert_product: str
) -> None:
    """Attention split by query rows (one prompt's too), experts by expert, projections by strip:
    3 threads = 1 thread."""
    batch = prefill_then_decode_batch(lens, news)
    layers = loaded.model.model.decoder_layers()
    outs = []
    try:
        for threads in (1, 3):
            assert cpu_layer.set_threads(threads) == threads
            outs.append([run_layer_both_ways(loaded.model, i, batch, seed=i)[1] for i in range(len(layers))])
    finally:
        cpu_layer.set_threads(1)
    for i, (one, three) in enumerate(zip(*outs, strict=True)):
        for a, b in zip(one, three, strict=True):
            assert torch.equal(a, b), f"layer {i}"


def test_thread_counts_change_between_calls(loaded: LoadedLLM) -> None:
    """Many short regions while the thread count changes call to call (workers created on first
    need must join the very next region): the same results every time, and no call hangs."""
    batch = prefill_then_decode_batch([40, 33, 21], [1, 1, 1])
    try:
        cpu_layer.set_threads(1)
        want = run_layer_both_ways(loaded.model, 3, batch, seed=9)[1]
        for i in range(60):
            cpu_layer.set_threads(1 + i % 4)
            got = run_layer_both_ways(loaded.model, 3, batch, seed=9)[1]
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), i
    finally:
        cpu_layer.set_threads(1)


def test_packed_strips_are_the_weight_by_column_blocks() -> None:
    w = torch.randn(5, 48)
    packed = torch.from_numpy(cpu_layer.pack_strips(w))  # type: ignore[arg-type]
    assert packed.shape == (3, 5, 16)
    assert torch.equal(torch.cat(list(packed), dim=1), w)
    assert cpu_layer.pack_strips(torch.randn(5, 40)) == b""  # not whole strips: no copy


def test_layer_with_qkv_bias_equals_the_modules(tiny_mimo_dir: Path) -> None:
    """Attention biases (which the tiny checkpoint lacks) are added like torch's linear adds them."""
    model = model_with_qkv_bias(tiny_mimo_dir, seed=31)
    batch = prefill_then_decode_batch([40, 33], [40, 33])  # BLAS: the modules' bits
    (out, res, k, v), (xk, rk, kk, vk) = run_layer_both_ways(model, 1, batch, seed=5)
    assert torch.equal(xk, out) and torch.equal(rk, res)
    assert torch.equal(kk, k) and torch.equal(vk, v)
    batch = prefill_then_decode_batch([40, 33], [1, 1])  # the packed copies, bias added after
    (out, res, k, v), (xk, rk, kk, vk) = run_layer_both_ways(model, 1, batch, seed=6)
    for a, b in ((xk, out), (rk, res), (kk, k), (vk, v)):
        assert rel_err(a, b) <= 1e-6


def test_paged_forward_equals_the_modules(loaded: LoadedLLM) -> None:
    """A prefill chunk then two decode steps of two sequences, with and without the layer kernel."""
    model, config = loaded.model, loaded.config
    assert all(layer.runner is model.backends.layer for layer in model.model.decoder_layers())
    outs = []
    for on in (True, False):
        with cpu_backends(model, **({} if on else {"layer": "none"})):
            outs.append(prefill_then_two_decode_steps(model, make_kv(config, 16)))
    assert rel_err(outs[0], outs[1]) <= 1e-6


def prefill_then_two_decode_steps(model: DecoderForCausalLM, kv: PagedKVCache) -> torch.Tensor:
    """The hidden states of a prefill chunk then two decode steps of two sequences."""
    ids = [prompt(29, seed=8), prompt(13, seed=9)]
    full_free, swa_free = free_lists(16, seed=2)
    seqs = [PagedSeq(full_free, swa_free) for _ in range(2)]
    hidden = [step(model, kv, seqs, [ids[0][:27], ids[1][:11]])]
    for t in (27, 28):
        hidden.append(step(model, kv, seqs, [ids[0][t : t + 1], ids[1][t - 16 : t - 15]]))
    return torch.cat(hidden)


def test_model_falls_back_to_the_modules(loaded: LoadedLLM) -> None:
    """The layer backend is chosen with the others (fp32 CPU, under the CPU attention backend) and
    takes the layers when ``after_load`` offers them; a model before ``after_load`` runs the torch
    reference. (Weights changed later are re-packed by calling ``after_load`` again: nothing
    compares tensor identities at step time.)"""
    model = loaded.model
    layers = model.model.decoder_layers()
    assert all(layer.runner is model.backends.layer for layer in layers)
    assert select_backends("cpu", torch.float64).layer.name == "none"  # not fp32
    unfused = DecoderForCausalLM(loaded.config)
    assert unfused.backends.names()["layer"] == "none"
    assert all(layer.runner is MODULES for layer in unfused.model.decoder_layers())
    with cpu_backends(model, attention="torch"):
        assert model.backends.layer.name == "none"
        assert all(layer.runner is MODULES for layer in layers)
    assert all(layer.runner is model.backends.layer for layer in layers)


def test_errors_are_value_errors(loaded: LoadedLLM) -> None:
    layer = loaded.model.model.decoder_layers()[2]
    weights = layer.block
    assert isinstance(weights, cpu_layer.LayerWeights)
    batch = prefill_then_decode_batch([12], [12])
    kv = zeroed_kv(loaded.config, 16)
    positions = batch.positions()
    cos, sin = layer.self_attn._cos_sin(positions, torch.float32, {})
    x = torch.randn(12, loaded.config.hidden_size)
    with pytest.raises(ValueError, match="x has"):
        cpu_layer.decoder_layer_cpu(
            weights, cpu_layer.StepArgs(batch), kv.layer(2), cos, sin, x[:11].clone(), x.clone(), False
        )
    half = zeroed_kv(loaded.config, 16, torch.float16)  # a pool dtype the kernel does not read
    with pytest.raises(ValueError, match="float32 or bf16"):
        cpu_layer.decoder_layer_cpu(
            weights, cpu_layer.StepArgs(batch), half.layer(2), cos, sin, x.clone(), x.clone(), False
        )
    bad = dataclasses.replace(batch, slots=tuple(s + 10**6 for s in batch.slots))
    before = kv.layer(2).k.clone()
    with pytest.raises(ValueError, match="outside the pool"):
        cpu_layer.decoder_layer_cpu(
            weights, cpu_layer.StepArgs(bad), kv.layer(2), cos, sin, x.clone(), x.clone(), False
        )
    assert torch.equal(kv.layer(2).k, before)  # checked before anything is written
    missing = dataclasses.replace(batch, page_tables=tuple(torch.full_like(t, -1) for t in batch.page_tables))
    with pytest.raises(ValueError, match="not in the pool"):
        cpu_layer.decoder_layer_cpu(
            weights, cpu_layer.StepArgs(missing), kv.layer(2), cos, sin, x.clone(), x.clone(), False
        )


# ---- bf16 storage: weights and KV pools in bf16; inputs float32 or bf16 products ---------------


@pytest.fixture
def float32_inputs() -> Iterator[None]:
    """bf16 weights with float32 product inputs (``cpu_layer.set_bf16_products(False)``), then the
    choice made at import again."""
    cpu_layer.set_bf16_products(False)
    yield
    cpu_layer.set_bf16_products(c_kernel.bf16_products_default())


@pytest.fixture
def bf16_products() -> Iterator[None]:
    cpu_layer.set_bf16_products(True)
    yield
    cpu_layer.set_bf16_products(c_kernel.bf16_products_default())


@pytest.fixture(scope="module")
def bf16_pair(tiny_mimo_dir: Path) -> tuple[DecoderForCausalLM, DecoderForCausalLM]:
    return bf16_and_twin(tiny_mimo_dir)


def bf16_and_twin(model_dir: Path) -> tuple[DecoderForCausalLM, DecoderForCausalLM]:
    """The checkpoint loaded in bf16, and a float32 twin holding exactly its values (every weight
    rounded to bf16, then widened), re-packed by ``after_load``."""
    bf16 = load_llm(model_dir, dtype=torch.bfloat16).model
    twin = load_llm(model_dir).model
    state = twin.state_dict()
    with torch.no_grad():
        for name, t in bf16.state_dict().items():
            if t.is_floating_point():
                state[name].copy_(t.float())
    twin.after_load()
    assert bf16.backends.layer.name == "cpu" and all(
        layer.runner is bf16.backends.layer for layer in bf16.model.decoder_layers()
    )
    return bf16, twin


def run_kernel(
    model: DecoderForCausalLM, i: int, batch: AttentionBatch, seed: int, kv: PagedKVCache
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, residual) after layer i through the layer kernel, its KV written into ``kv``."""
    layer, config = model.model.layers[i], model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch.num_tokens, config.hidden_size, generator=g)
    residual = torch.randn(batch.num_tokens, config.hidden_size, generator=g)
    cos, sin = layer.self_attn._cos_sin(batch.positions(), torch.float32, {})
    weights = layer.block
    assert isinstance(weights, cpu_layer.LayerWeights)
    cpu_layer.decoder_layer_cpu(
        weights, cpu_layer.StepArgs(batch), kv.layer(i), cos, sin, x, residual, i == 0
    )
    return x, residual


@pytest.mark.parametrize("news", [[40, 33], [1, 1]])  # BLAS (widened weights) / the packed bf16 strips
def test_bf16_weights_give_the_bits_of_their_float32_values(
    bf16_pair: tuple[DecoderForCausalLM, DecoderForCausalLM],
    news: list[int],
    expert_product: str,
    float32_inputs: None,
) -> None:
    """A bf16 weight widens to float32 exactly as it is read, and the products and sums run as for a
    float32 weight: every layer's output, residual and stored KV equal the float32 twin's bit for bit."""
    bf16, twin = bf16_pair
    batch = prefill_then_decode_batch([40, 33], news)
    for i in range(len(bf16.model.layers)):
        kv_a, kv_b = zeroed_kv(bf16.config, 16), zeroed_kv(bf16.config, 16)
        got, want = run_kernel(bf16, i, batch, i, kv_a), run_kernel(twin, i, batch, i, kv_b)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"layer {i}"
        assert torch.equal(kv_a.layer(i).k, kv_b.layer(i).k) and torch.equal(kv_a.layer(i).v, kv_b.layer(i).v)


def test_bf16_projections_wider_than_a_widened_block_give_the_float32_bits(
    tmp_path_factory: pytest.TempPathFactory, float32_inputs: None
) -> None:
    """A prefill's projections widen a bf16 weight 512 columns at a time and run BLAS with its own
    threads on each block: a dense MLP of 640 gate/up columns (512 + 128) still gives the float32
    twin's bits, layer by layer."""
    wide = build_tiny_mimo(tmp_path_factory.mktemp("wide_mimo"), tokenizer=False, intermediate_size=320)
    bf16, twin = bf16_and_twin(wide)
    assert any(isinstance(layer.mlp, DenseMLP) for layer in bf16.model.decoder_layers())
    batch = prefill_then_decode_batch([40, 33], [40, 33])
    assert batch.num_tokens > cpu_layer.PACKED_MAX_ROWS  # every projection through BLAS
    for i in range(len(bf16.model.layers)):
        kv_a, kv_b = zeroed_kv(bf16.config, 16), zeroed_kv(bf16.config, 16)
        got, want = run_kernel(bf16, i, batch, i, kv_a), run_kernel(twin, i, batch, i, kv_b)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"layer {i}"


@pytest.mark.parametrize("news", [[40, 33], [1, 1]])  # BLAS / the packed strips
def test_bf16_products_round_the_inputs_and_agree_in_every_product(
    bf16_pair: tuple[DecoderForCausalLM, DecoderForCausalLM],
    news: list[int],
    expert_product: str,
    bf16_products: None,
) -> None:
    """bf16 products: every product's inputs rounded to bf16, as a bf16 model's are. Each layer is
    then near its float32-input twin (another rounding of the inputs, not another computation),
    but not equal to it; and products of many rows give the same answer in MKL's bf16 product as
    in sgemm over the widened weight, float32 sums apart."""
    bf16, twin = bf16_pair
    batch = prefill_then_decode_batch([40, 33], news)
    for i in range(len(bf16.model.layers)):
        outs = []
        for gemm in (True, False):
            cpu_moe.set_bf16_gemm(gemm)
            outs.append(run_kernel(bf16, i, batch, i, zeroed_kv(bf16.config, 16)))
        cpu_moe.set_bf16_gemm(c_kernel.bf16_products_default())
        want = run_kernel(twin, i, batch, i, zeroed_kv(bf16.config, 16))
        assert rel_err(outs[0][0], outs[1][0]) <= 1e-5, f"layer {i}"
        assert rel_err(outs[0][1], outs[1][1]) <= 1e-5, f"layer {i}"
        assert 1e-5 < rel_err(outs[0][0], want[0]) <= 1e-2, f"layer {i}"


@pytest.mark.parametrize("news", [[40, 33], [1, 1]])
def test_bf16_kv_pools_store_as_torch_rounds_and_attend_like_the_modules(
    loaded: LoadedLLM, news: list[int]
) -> None:
    """bf16 pools under float32 weights: each key and value the kernel stores is the float32 one
    it stores into float32 pools, rounded as torch's ``.to(torch.bfloat16)`` (exactly), and the
    layer attends over the widened values as the torch reference does (float32 rounding apart)."""
    model, config = loaded.model, loaded.config
    batch = prefill_then_decode_batch([40, 33], news)
    with cpu_backends(model, attention="torch", layer="none"):  # torch attention reads bf16 pools
        kv_ref = zeroed_kv(config, 16, torch.bfloat16)
        refs = []
        for i, layer in enumerate(model.model.layers):
            g = torch.Generator().manual_seed(i)
            x = torch.randn(batch.num_tokens, config.hidden_size, generator=g)
            residual = torch.randn(batch.num_tokens, config.hidden_size, generator=g)
            refs.append(layer(x, None if i == 0 else residual, batch.positions(), batch, kv_ref, {}, batch))
    kv, kv_f32 = zeroed_kv(config, 16, torch.bfloat16), zeroed_kv(config, 16)
    for i, (out, res) in enumerate(refs):
        xk, rk = run_kernel(model, i, batch, i, kv)
        run_kernel(model, i, batch, i, kv_f32)
        for pool, f32 in ((kv.layer(i).k, kv_f32.layer(i).k), (kv.layer(i).v, kv_f32.layer(i).v)):
            assert pool.dtype == torch.bfloat16 and torch.equal(pool, f32.to(torch.bfloat16))
        assert rel_err(rk, res) <= 1e-5 and rel_err(xk, out) <= 1e-5, f"layer {i}"


def test_bf16_model_forward_runs_the_layer_kernel_in_float32(
    bf16_pair: tuple[DecoderForCausalLM, DecoderForCausalLM],
) -> None:
    """The paged forward of the bf16 model (bf16 weights and pools) against its float32 twin (fp32
    pools): hidden states apart only by the pools' bf16 rounding, and greedy picks that agree."""
    bf16, twin = bf16_pair
    outs = [
        prefill_then_two_decode_steps(model, make_kv(model.config, 16, dtype))
        for model, dtype in ((bf16, torch.bfloat16), (twin, torch.float32))
    ]
    assert outs[0].dtype == torch.float32
    assert rel_err(outs[0], outs[1]) <= 2e-2  # keys and values rounded to 8 bits of mantissa
    logits = [model.compute_logits(h) for model, h in zip((bf16, twin), outs, strict=True)]
    agree = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean()
    assert agree >= 0.9, agree
