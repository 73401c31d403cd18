"""DecoderForCausalLM parity: dense and paged forward vs transformers' MiMoV2FlashForCausalLM, chunked
prefill vs one chunk, decode steps vs dense, and a mixed batch vs each sequence alone.

KV lives in the real PagedKVCache (poisoned with NaN). Pages are handed out here from shuffled free
lists rather than by the allocator, so page tables are deliberately non-contiguous and an indexing
slip in the slot or table math cannot cancel out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from llm_core.backends.selector import select_backends
from llm_core.caches.kv_pool import KVLayout, PagedKVCache
from llm_core.kernels import cpu_attention
from llm_core.kernels.attention_batch import build_attention_batch
from llm_core.models.checkpoint import LoadedLLM, load_llm
from llm_core.models.config import DecoderConfig
from llm_core.models.decoder import DecoderForCausalLM

PAGE = 16
REL_TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def make_kv(
    config: DecoderConfig, num_pages: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> PagedKVCache:
    """The real dual pool, poisoned with NaN so a read of a slot nobody wrote is loud."""
    layout = KVLayout.from_model_config(config, dtype)
    kv = PagedKVCache(layout, PAGE, dtype, device, group_pages=num_pages)
    for i in range(kv.num_layers):
        kv.layer(i).k.fill_(float("nan"))
        kv.layer(i).v.fill_(float("nan"))
    return kv


class PagedSeq:
    """One sequence's pages in both pools, allocated from shuffled free lists."""

    def __init__(self, full_free: list[int], swa_free: list[int]) -> None:
        self.full: list[int] = []
        self.swa: list[int | None] = []
        self.full_free, self.swa_free = full_free, swa_free
        self.len = 0

    def grow(self, new_len: int) -> None:
        while len(self.full) * PAGE < new_len:
            self.full.append(self.full_free.pop())
            self.swa.append(self.swa_free.pop())
        self.len = new_len


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def free_lists(num_pages: int, seed: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(num_pages, generator=g).tolist(), torch.randperm(num_pages, generator=g).tolist()


def model_with_qkv_bias(tiny_mimo_dir: Path, seed: int) -> DecoderForCausalLM:
    """The tiny config with attention biases (which the tiny checkpoint lacks), random weights, fused."""
    config = dataclasses.replace(DecoderConfig.from_pretrained_dir(tiny_mimo_dir), attention_bias=True)
    model = DecoderForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.08)
    model.after_load()
    assert model.model.decoder_layers()[0].self_attn.qkv_bias is not None
    return model


@contextlib.contextmanager
def cpu_backends(model: DecoderForCausalLM, **override: str) -> Iterator[None]:
    """Run ``model`` (fp32, CPU) with the CPU backends but for ``override`` (e.g. attention="torch"),
    then with the default choice again."""
    model.after_load(select_backends("cpu", torch.float32, **override))
    try:
        yield
    finally:
        model.after_load()


def step(
    model: DecoderForCausalLM,
    kv: PagedKVCache,
    seqs: list[PagedSeq],
    chunks: list[torch.Tensor],
    device: str = "cpu",
) -> torch.Tensor:
    """Run one packed step; each seq appends its chunk. Returns hidden [T, hidden]."""
    lens, news = [], []
    for s, c in zip(seqs, chunks, strict=True):
        s.grow(s.len + len(c))
        lens.append(s.len)
        news.append(len(c))
    batch = build_attention_batch(lens, news, [[s.full for s in seqs], [s.swa for s in seqs]], PAGE, device)
    ids = torch.cat(chunks).to(device)
    return model(ids, batch.positions(), batch, kv)


def test_config_reads_transformers_layout(loaded: LoadedLLM, tiny_mimo_hf: Any) -> None:
    cfg, hf = loaded.config, tiny_mimo_hf.config
    assert cfg.layer_types == tuple(hf.layer_types)
    assert cfg.full_layer_ids == (0, 5) and cfg.is_full_layer(5) and not cfg.is_full_layer(6)
    assert cfg.num_kv_heads(0) == hf.num_key_value_heads
    assert cfg.num_kv_heads(1) == 2 * hf.num_key_value_heads  # transformers doubles SWA KV heads
    assert cfg.sliding_window == hf.sliding_window
    assert cfg.rope_theta_of(0) != cfg.rope_theta_of(1)
    assert cfg.rotary_dim(0) == 10  # int(32 * 0.334) = 10 rotated dims of 32


def test_forward_dense_matches_transformers(loaded: LoadedLLM, tiny_mimo_hf: Any) -> None:
    ids = prompt(40)[None]  # 40 tokens, window 8
    with torch.no_grad():
        ref = tiny_mimo_hf(ids).logits
    out = loaded.model.forward_dense(ids)
    assert out.shape == ref.shape
    assert rel_err(out, ref) <= REL_TOL


def test_fused_projections_equal_separate_ones(tiny_mimo_dir: Path) -> None:
    """load_llm stacks q/k/v (and the dense MLP's gate/up); the stacked path gives the same logits
    as the three separate projections (an unfused copy of the same weights), paged and dense."""
    fused = load_llm(tiny_mimo_dir).model
    plain = load_llm(tiny_mimo_dir).model
    for module in plain.modules():
        for name in ("qkv_weight", "qkv_bias", "gate_up_weight"):
            if getattr(module, name, None) is not None:
                setattr(module, name, None)
    assert fused.model.layers[0].self_attn.qkv_weight is not None
    ids = prompt(30, seed=4)
    torch.testing.assert_close(
        fused.forward_dense(ids[None]), plain.forward_dense(ids[None]), rtol=1e-5, atol=1e-5
    )
    outs = []
    for model in (fused, plain):
        kv = make_kv(model.config, 8)
        outs.append(step(model, kv, [PagedSeq(*free_lists(8, seed=0))], [ids]))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_forward_dense_with_input_embeds_matches_transformers(loaded: LoadedLLM, tiny_mimo_hf: Any) -> None:
    ids = prompt(24, seed=3)[None]
    embeds = tiny_mimo_hf.get_input_embeddings()(ids).detach().clone()
    embeds[0, 5:11] = torch.randn(6, embeds.shape[-1], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = tiny_mimo_hf(inputs_embeds=embeds).logits
    assert rel_err(loaded.model.forward_dense(ids, input_embeds=embeds), ref) <= REL_TOL


def test_paged_prefill_matches_transformers(loaded: LoadedLLM, tiny_mimo_hf: Any) -> None:
    ids = prompt(45, seed=1)
    with torch.no_grad():
        ref = tiny_mimo_hf(ids[None]).logits[0]
    kv = make_kv(loaded.config, 8)
    seq = PagedSeq(*free_lists(8, seed=0))
    hidden = step(loaded.model, kv, [seq], [ids])
    logits = loaded.model.compute_logits(hidden)
    assert rel_err(logits, ref) <= REL_TOL


@pytest.mark.parametrize("chunk_sizes", [(20, 25), (5, 7, 3, 16, 14)])
def test_chunked_prefill_equals_one_chunk(loaded: LoadedLLM, chunk_sizes: tuple[int, ...]) -> None:
    ids = prompt(sum(chunk_sizes), seed=2)
    model = loaded.model
    one = step(model, make_kv(loaded.config, 8), [PagedSeq(*free_lists(8, 1))], [ids])
    kv = make_kv(loaded.config, 8)
    seq = PagedSeq(*free_lists(8, 2))
    parts, start = [], 0
    for n in chunk_sizes:
        parts.append(step(model, kv, [seq], [ids[start : start + n]]))
        start += n
    chunked = torch.cat(parts)
    assert rel_err(chunked, one) <= 1e-5


def test_decode_steps_match_dense_with_swa_pages_freed(loaded: LoadedLLM) -> None:
    model, window = loaded.model, loaded.config.sliding_window
    ids = prompt(60, seed=4)
    kv = make_kv(loaded.config, 8)
    seq = PagedSeq(*free_lists(8, 3))
    step(model, kv, [seq], [ids[:30]])
    for pos in range(30, 60):
        # Before computing the token at `pos`, SWA pages wholly before pos - W + 1 are gone: poison them
        # in every SWA layer and drop them from the table; decode must not notice.
        first_needed = pos - window + 1
        for i, page in enumerate(seq.swa[: max(0, first_needed) // PAGE]):
            if page is not None:
                for lk in (kv.layer(j) for j in range(kv.num_layers)):
                    if lk.window is not None:
                        lk.k[page].fill_(float("nan"))
                        lk.v[page].fill_(float("nan"))
            seq.swa[i] = None
        hidden = step(model, kv, [seq], [ids[pos : pos + 1]])
        if pos % 7 == 0 or pos == 59:
            dense = model.forward_dense(ids[None, : pos + 1])[0, -1]
            assert rel_err(model.compute_logits(hidden)[0], dense) <= REL_TOL, pos
    assert seq.swa[0] is None and seq.swa[1] is None


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_mixed_batch_equals_each_sequence_alone(loaded: LoadedLLM, backend: str) -> None:
    """One step with a decode, a first prefill chunk and a later prefill chunk equals dense per
    sequence, through the C kernel and through the torch reference."""
    if backend == "cpu" and not cpu_attention.AVAILABLE:
        pytest.skip("llm_core.kernels._paged_attention is not built")
    model = loaded.model
    with cpu_backends(model, attention=backend):
        kv = make_kv(loaded.config, 24)
        full_free, swa_free = free_lists(24, 5)
        seqs = [PagedSeq(full_free, swa_free) for _ in range(3)]
        ids = [prompt(34, seed=10), prompt(21, seed=11), prompt(40, seed=12)]
        # warm-up: seq0 has 33 tokens cached, seq2 has 17; seq1 starts fresh in the mixed step
        step(model, kv, [seqs[0], seqs[2]], [ids[0][:33], ids[2][:17]])
        chunks = [ids[0][33:34], ids[1], ids[2][17:40]]
        hidden = step(model, kv, seqs, chunks)
        logits = model.compute_logits(hidden)
        offsets = [0, 1, 1 + 21, 1 + 21 + 23]
        for b, (lo, hi) in enumerate(itertools.pairwise(offsets)):
            n_total = seqs[b].len
            dense = model.forward_dense(ids[b][None, :n_total])[0, n_total - (hi - lo) :]
            assert rel_err(logits[lo:hi], dense) <= REL_TOL, b


def test_embed_then_input_embeds_is_same_as_ids(loaded: LoadedLLM) -> None:
    model, ids = loaded.model, prompt(19, seed=7)
    a = step(model, make_kv(loaded.config, 4), [PagedSeq(*free_lists(4, 0))], [ids])
    kv = make_kv(loaded.config, 4)
    seq = PagedSeq(*free_lists(4, 0))
    seq.grow(19)
    batch = build_attention_batch([19], [19], [[seq.full], [seq.swa]], PAGE)
    b = model(ids, batch.positions(), batch, kv, input_embeds=model.embed(ids))
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels on the GPU)")
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_cuda_triton_paged_matches_cpu_dense(tiny_mimo_dir: Path, dtype: torch.dtype, tol: float) -> None:
    """On CUDA the model takes the Triton prefill and decode kernels; compare with the CPU reference."""
    cpu = load_llm(tiny_mimo_dir).model
    gpu_loaded = load_llm(tiny_mimo_dir, dtype=dtype, device="cuda")
    ids = prompt(50, seed=21)
    kv = make_kv(gpu_loaded.config, 8, dtype, "cuda")
    seq = PagedSeq(*free_lists(8, 4))
    outs = [step(gpu_loaded.model, kv, [seq], [ids[:37]], "cuda")]
    outs += [step(gpu_loaded.model, kv, [seq], [ids[p : p + 1]], "cuda") for p in range(37, 50)]
    logits = gpu_loaded.model.compute_logits(torch.cat(outs)).cpu()
    dense = cpu.forward_dense(ids[None])[0]
    assert rel_err(logits, dense) <= tol


@pytest.mark.skipif(not cpu_attention.AVAILABLE, reason="llm_core.kernels._paged_attention is not built")
def test_fused_cpu_layer_with_qkv_bias_equals_torch_path(tiny_mimo_dir: Path) -> None:
    """With attention biases (which the tiny checkpoint lacks), the fused CPU layer (one kernel
    call from the qkv rows to the attention output) equals the torch path: rotary, write_kv and
    the torch paged attention, for a prefill chunk and then a decode step."""
    model = model_with_qkv_bias(tiny_mimo_dir, seed=21)
    config = model.config
    ids = prompt(23, seed=22)
    outs = []
    for backend in ("cpu", "torch"):
        model.after_load(select_backends("cpu", torch.float32, attention=backend))
        kv = make_kv(config, 8)
        seq = PagedSeq(*free_lists(8, seed=1))
        prefill = step(model, kv, [seq], [ids[:22]])
        outs.append(torch.cat([prefill, step(model, kv, [seq], [ids[22:]])]))
    assert rel_err(outs[0], outs[1]) <= 1e-5


def test_rope_tables_are_the_rotary_of_the_positions(loaded: LoadedLLM) -> None:
    """Rows gathered from the model's per-position tables equal the rotary computed for the step's
    positions, and the tables grow (doubling) when a position first passes their end."""
    model = loaded.model
    model._rope_cache.clear()
    for positions in (torch.tensor([0, 5, 3, 1023]), torch.tensor([1024, 7, 4000])):
        tables = model.rope_tables(positions, torch.float32)
        rotaries = {
            layer.self_attn.rotary.key: layer.self_attn.rotary for layer in model.model.decoder_layers()
        }
        assert set(tables) == set(rotaries) and len(tables) == 2  # full and SWA layers' theta
        for key, (cos, sin) in tables.items():
            ref_cos, ref_sin = rotaries[key].cos_sin(positions, torch.float32)
            torch.testing.assert_close(cos, ref_cos, rtol=0, atol=1e-6)
            torch.testing.assert_close(sin, ref_sin, rtol=0, atol=1e-6)
    assert {t[0].shape[0] for t in model._rope_cache.values()} == {4096}


def shared_kv(config: DecoderConfig, num_blocks: int, seed: int) -> PagedKVCache:
    """One shared block pool (``kv_blocks``), poisoned with NaN, its free blocks shuffled so that a
    page's blocks and the pages of a sequence are scattered through the slot tensors."""
    kv = PagedKVCache(KVLayout.from_model_config(config, torch.float32), PAGE, num_blocks=num_blocks)
    for i in range(kv.num_layers):
        kv.layer(i).k.fill_(float("nan"))
        kv.layer(i).v.fill_(float("nan"))
    assert kv.blocks is not None
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    kv.blocks._free[:] = order
    return kv


def viewed_step(
    model: DecoderForCausalLM, kv: PagedKVCache, seqs: list[PagedSeq], chunks: list[torch.Tensor]
) -> torch.Tensor:
    """``step`` on a shared pool: pages come from each group's allocator, and the batch's group
    tables are mapped to the layers' views (``page_map``) as the model runner maps them."""
    lens, news = [], []
    for s, c in zip(seqs, chunks, strict=True):
        while len(s.full) * PAGE < s.len + len(c):
            full, swa = kv.pools[0].alloc(1), kv.pools[1].alloc(1)
            assert full is not None and swa is not None
            s.full.append(full[0])
            s.swa.append(swa[0])
        s.len += len(c)
        lens.append(s.len)
        news.append(len(c))
    batch = build_attention_batch(lens, news, [[s.full for s in seqs], [s.swa for s in seqs]], PAGE)
    tables, slots = kv.page_map.view_tables(batch.page_tables, batch.slots, PAGE)
    batch = dataclasses.replace(batch, page_tables=tables, slots=slots)
    return model(torch.cat(chunks), batch.positions(), batch, kv)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_one_shared_block_pool_gives_the_per_group_pools_outputs(loaded: LoadedLLM, backend: str) -> None:
    """Two sequences, a chunked prefill and decodes, on a pool per group and on one shared block
    pool whose layers are views (2 full layers share a slot, the SWA group's page is 5 blocks): the
    same hidden states, so no layer reads or writes another's pages."""
    model = loaded.model
    ids = [prompt(41, seed=5), prompt(29, seed=6)]
    with cpu_backends(model, **({} if backend == "cpu" else {"attention": "torch"})):
        outs = []
        for shared in (False, True):
            kv = shared_kv(loaded.config, 64, seed=7) if shared else make_kv(loaded.config, 16)
            run = viewed_step if shared else step
            free = free_lists(16, seed=8) if not shared else ([], [])  # one free list per group for both
            seqs = [PagedSeq(*free), PagedSeq(*free)]
            hidden = [run(model, kv, seqs, [ids[0][:17], ids[1][:29]])]
            hidden.append(run(model, kv, seqs[:1], [ids[0][17:]]))
            for j in range(6):  # decodes of both
                hidden.append(run(model, kv, seqs, [prompt(1, seed=20 + j), prompt(1, seed=40 + j)]))
            outs.append(torch.cat(hidden))
    assert kv.block_layout is not None and kv.block_layout.blocks_per_page == (1, 5)
    assert len(set(kv.page_map.layer_view)) == 7  # 2 full layers in one slot, 5 SWA sub-blocks
    assert not outs[1].isnan().any()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
