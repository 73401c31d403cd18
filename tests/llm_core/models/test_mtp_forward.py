"""The MTP heads' forward (llm_core/models/mtp.py): ``forward_layer_dense`` against a reference written
here from the documented math, the paged ``forward_layer`` against the dense one (chunked prefill of
two sequences in one batch, decode rows, SWA pages dropped), chained drafting, autograd, and the
MiMo-V2.5 release-layout fixture's loaded heads.

The reference uses torch primitives only (RMSNorm, half-split partial rotary, softmax attention
with the window and a per-head sink logit, SwiGLU) and shares no code with mtp.py or decoder.py.
Head j at position i (see mtp.py)::

    x = eh_proj(cat(enorm(embed(t_{i+j+1})), hnorm(h^j_i)));  x += attn(input_layernorm(x))
    x += mlp(pre_mlp_layernorm(x));                            h^{j+1}_i = final_layernorm(x)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from llm_core.backends.selector import reference_backends, select_backends
from llm_core.caches.kv_pool import KVLayout, PagedKVCache
from llm_core.kernels import cpu_attention
from llm_core.kernels.attention_batch import AttentionBatch, build_attention_batch
from llm_core.models.checkpoint import LoadedLLM, default_llm_config, load_llm
from llm_core.models.config import DecoderConfig
from llm_core.models.decoder import DecoderForCausalLM
from llm_core.models.mtp import MTPHeads
from llm_core.models.random_init import init_random_weights
from tests.fixtures import mimo_v2 as fx
from tests.llm_core.models.test_decoder import PAGE, free_lists

NUM_HEADS = 3
ATOL = 1e-5


# ---- the reference -------------------------------------------------------------------------------


def ref_rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_rotary(x: Tensor, positions: Tensor, cfg: DecoderConfig) -> Tensor:
    """x [S, H, D]: the first 2 * ceil(rope_dim / 2) dims rotate in half-split pairs (j, j + half),
    frequency theta^(-2j / rope_dim), rope_dim = int(head_dim * swa_partial_rotary_factor)."""
    rope_dim = int(cfg.head_dim * cfg.swa_partial_rotary_factor)
    half = (rope_dim + 1) // 2
    inv_freq = 1.0 / cfg.swa_rope_theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    angle = positions.float()[:, None] * inv_freq[None, :]  # [S, half]
    c, s = angle.cos()[:, None, :], angle.sin()[:, None, :]  # [S, 1, half]
    a, b = x[..., :half], x[..., half : 2 * half]
    return torch.cat([a * c - b * s, b * c + a * s, x[..., 2 * half :]], dim=-1)


def ref_attention(q: Tensor, k: Tensor, v: Tensor, window: int | None, sinks: Tensor | None) -> Tensor:
    """q [S, H, D], k [S, Hkv, D], v [S, Hkv, Dv] -> [S, H, Dv]: query i sees keys j with
    i - window < j <= i, plus one extra logit per head (the sink) that takes probability and no value."""
    n, heads, dim = q.shape
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [S, H, .]
    scores = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(dim)  # [H, S, S]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (j > i - window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(heads, 1, 1).expand(heads, n, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :n]
    return torch.einsum("hij,jhd->ihd", probs, v)


def ref_head(
    params: Mapping[str, Tensor],
    cfg: DecoderConfig,
    embeds: Tensor,
    prev_hidden: Tensor,
    *,
    swap: bool = False,
    window: int | None = -1,
    sinks: bool = True,
) -> Tensor:
    """One head over a sequence at positions 0 .. S-1. embeds, prev_hidden [S, hidden] -> [S, hidden].
    ``swap``, ``window`` (-1: the config's), ``sinks``: deliberate departures, to show the test bites."""
    eps, n = cfg.rms_norm_eps, embeds.shape[0]
    heads, kv_heads, dim, vdim = (
        cfg.num_attention_heads,
        cfg.swa_num_key_value_heads,
        cfg.head_dim,
        cfg.v_head_dim,
    )
    e = ref_rms(embeds, params["enorm.weight"], eps)
    h = ref_rms(prev_hidden, params["hnorm.weight"], eps)
    x = torch.cat([h, e] if swap else [e, h], dim=-1) @ params["eh_proj.weight"].T
    a = ref_rms(x, params["input_layernorm.weight"], eps)
    pos = torch.arange(n)
    q = ref_rotary((a @ params["self_attn.q_proj.weight"].T).view(n, heads, dim), pos, cfg)
    k = ref_rotary((a @ params["self_attn.k_proj.weight"].T).view(n, kv_heads, dim), pos, cfg)
    v = (a @ params["self_attn.v_proj.weight"].T).view(n, kv_heads, vdim) * cfg.attention_value_scale
    o = ref_attention(
        q,
        k,
        v,
        cfg.sliding_window if window == -1 else window,
        params["self_attn.sinks"] if sinks else None,
    )
    x = x + o.reshape(n, heads * vdim) @ params["self_attn.o_proj.weight"].T
    m = ref_rms(x, params["pre_mlp_layernorm.weight"], eps)
    gate, up = m @ params["mlp.gate_proj.weight"].T, m @ params["mlp.up_proj.weight"].T
    x = x + (F.silu(gate) * up) @ params["mlp.down_proj.weight"].T
    return ref_rms(x, params["final_layernorm.weight"], eps)


# ---- models and inputs ---------------------------------------------------------------------------


def random_heads(cfg: DecoderConfig, seed: int) -> MTPHeads:
    """Heads with weights large enough that every part matters: matrices ~ 1/sqrt(fan_in), norms
    near 1, sinks ~ N(0, 1) (so some heads put real weight on the sink)."""
    heads = MTPHeads(cfg, NUM_HEADS).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
    heads.after_load(reference_backends())  # packed for a paged forward; the dense one reads the modules
    return heads.requires_grad_(False)


@pytest.fixture(scope="module")
def cfg() -> DecoderConfig:
    return default_llm_config()


@pytest.fixture(scope="module")
def target(cfg: DecoderConfig) -> DecoderForCausalLM:
    model = DecoderForCausalLM(cfg).eval()
    init_random_weights(model, seed=3, std=0.5)  # embeddings of norm ~8: enorm must rescale them
    model.after_load(reference_backends())  # the torch reference's kernels over the packed weights
    return model.requires_grad_(False)


@pytest.fixture(scope="module")
def heads(cfg: DecoderConfig) -> MTPHeads:
    return random_heads(cfg, seed=7)


def ids(n: int, seed: int, vocab: int = 512) -> Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def hiddens(n: int, hidden: int, seed: int) -> Tensor:
    return torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed))


def mtp_kv(config: DecoderConfig, num_pages: int, dtype: torch.dtype = torch.float32) -> PagedKVCache:
    """The dual pool with the heads' layers appended, poisoned with NaN (a read nobody wrote is loud)."""
    layout = KVLayout.from_model_config(config, dtype, mtp_layers=NUM_HEADS)
    kv = PagedKVCache(layout, PAGE, dtype, group_pages=num_pages)
    for i in range(kv.num_layers):
        kv.layer(i).k.fill_(float("nan"))
        kv.layer(i).v.fill_(float("nan"))
    return kv


class Pages:
    """One sequence's page lists (full and SWA) from shuffled free lists."""

    def __init__(self, full_free: list[int], swa_free: list[int]) -> None:
        self.full: list[int] = []
        self.swa: list[int | None] = []
        self.full_free, self.swa_free = full_free, swa_free

    def cover(self, n: int) -> None:
        while len(self.full) * PAGE < n:
            self.full.append(self.full_free.pop())
            self.swa.append(self.swa_free.pop())

    def drop_before(self, first_needed: int, kv: PagedKVCache, layers: range) -> None:
        """Unmap (and poison in ``layers``) SWA pages wholly before position ``first_needed``."""
        for i in range(max(0, first_needed) // PAGE):
            page = self.swa[i]
            if page is not None:
                for layer in layers:
                    kv.layer(layer).k[page].fill_(float("nan"))
                    kv.layer(layer).v[page].fill_(float("nan"))
                self.swa[i] = None


def batch_of(seqs: list[Pages], spans: list[tuple[int, int]]) -> AttentionBatch:
    """The batch of rows [start, end) of each sequence (seq_lens = end), as the runner builds it."""
    for s, (_, end) in zip(seqs, spans, strict=True):
        s.cover(end)
    return build_attention_batch(
        [e for _, e in spans],
        [e - s for s, e in spans],
        [[s.full for s in seqs], [s.swa for s in seqs]],
        PAGE,
    )


def run_paged(
    heads: MTPHeads,
    target: DecoderForCausalLM,
    kv: PagedKVCache,
    tokens: list[Tensor],
    inputs: list[Tensor],
    steps: Sequence[tuple[int, ...]],
    chain: bool,
) -> list[Tensor]:
    """Every head over the rows of each sequence, fed step by step (``steps[k][b]`` new rows of
    sequence b in step k). tokens[b] [D, S_b] (row i of head j: t_{i+j+1}); inputs[b] [D, S_b, hidden]:
    h^j of each head, or (``chain``) only inputs[b][0] is used and head j > 0 takes head j - 1's
    output of the same step. SWA pages that left every window are dropped and poisoned before each
    step. Returns outputs[b] [D, S_b, hidden]."""
    layers = range(target.config.num_hidden_layers, target.config.num_hidden_layers + heads.num_layers)
    window = target.config.sliding_window
    full_free, swa_free = free_lists(kv.pools[0].num_pages, seed=11)
    seqs = [Pages(full_free, swa_free) for _ in tokens]
    done = [0] * len(tokens)
    outs: list[list[list[Tensor]]] = [[[] for _ in range(heads.num_layers)] for _ in tokens]
    for counts in steps:
        spans = [(d, d + c) for d, c in zip(done, counts, strict=True)]
        for s, (start, _) in zip(seqs, spans, strict=True):
            s.drop_before(start - window + 1, kv, layers)
        batch = batch_of(seqs, spans)
        positions = batch.positions()
        rope = target.rope_tables(positions, torch.float32)
        prev = torch.cat([inputs[b][0, s:e] for b, (s, e) in enumerate(spans)])
        for j in range(heads.num_layers):
            tok = torch.cat([tokens[b][j, s:e] for b, (s, e) in enumerate(spans)])
            if not chain:
                prev = torch.cat([inputs[b][j, s:e] for b, (s, e) in enumerate(spans)])
            prev = heads.forward_layer(j, tok, prev, positions, batch, kv, target.embed, rope)
            offsets = [0, *torch.cumsum(torch.tensor(counts), 0).tolist()]
            for b in range(len(tokens)):
                outs[b][j].append(prev[offsets[b] : offsets[b + 1]])
        done = [e for _, e in spans]
    return [torch.stack([torch.cat(o) for o in per_seq]) for per_seq in outs]


def run_dense(
    heads: MTPHeads, target: DecoderForCausalLM, tokens: Tensor, inputs: Tensor, chain: bool
) -> Tensor:
    """``run_paged``'s counterpart for one sequence: tokens [D, S], inputs [D, S, hidden] -> [D, S, hidden]."""
    out, prev = [], inputs[0]
    for j in range(heads.num_layers):
        if not chain:
            prev = inputs[j]
        prev = heads.forward_layer_dense(j, tokens[j], prev, target.embed, target.rope_tables)
        out.append(prev)
    return torch.stack(out)


def chain_tokens(seq: Tensor, rows: int) -> Tensor:
    """seq [n] -> [D, rows]: head j's row i reads t_{i+j+1}."""
    return torch.stack([seq[j + 1 : j + 1 + rows] for j in range(NUM_HEADS)])


# ---- dense vs the reference ----------------------------------------------------------------------


@torch.no_grad()
@pytest.mark.parametrize("j", range(NUM_HEADS))
def test_dense_matches_reference(
    cfg: DecoderConfig, target: DecoderForCausalLM, heads: MTPHeads, j: int
) -> None:
    """300 tokens, window 128: rows far past the window, every head (each its own weights)."""
    n = 300
    assert n > 2 * cfg.sliding_window
    tok, prev = ids(n, seed=j), hiddens(n, cfg.hidden_size, seed=10 + j)
    ours = heads.forward_layer_dense(j, tok, prev, target.embed, target.rope_tables)
    params = dict(heads.heads()[j].named_parameters())
    ref = ref_head(params, cfg, target.embed(tok), prev)
    assert ours.shape == (n, cfg.hidden_size)
    assert torch.allclose(ours, ref, atol=ATOL, rtol=0), (ours - ref).abs().max()


@torch.no_grad()
def test_reference_departures_are_detected(
    cfg: DecoderConfig, target: DecoderForCausalLM, heads: MTPHeads
) -> None:
    """The comparison above can fail: the concat order, the window and the sinks each move the
    output by far more than its tolerance (and the rows past the window are where the window shows)."""
    n, j = 300, 1
    tok, prev = ids(n, seed=1), hiddens(n, cfg.hidden_size, seed=11)
    ours = heads.forward_layer_dense(j, tok, prev, target.embed, target.rope_tables)
    params = dict(heads.heads()[j].named_parameters())
    emb = target.embed(tok)
    no_window = ref_head(params, cfg, emb, prev, window=None)
    departures = {
        "hidden first": ref_head(params, cfg, emb, prev, swap=True),
        "no window": no_window,
        "no sinks": ref_head(params, cfg, emb, prev, sinks=False),
    }
    for name, off in departures.items():
        assert (ours - off).abs().max() > 1000 * ATOL, name
    w = cfg.sliding_window
    assert torch.allclose(ours[:w], no_window[:w], atol=ATOL, rtol=0)  # same until the window slides


def test_dense_trains(cfg: DecoderConfig, target: DecoderForCausalLM) -> None:
    """Autograd through a two-head chain from the target's (inference-mode) hidden states: every
    parameter of both heads gets the reference's gradient."""
    heads = random_heads(cfg, seed=5).requires_grad_(True)
    n = 160
    seq = ids(n + NUM_HEADS, seed=21)
    kv = mtp_kv(cfg, 16)
    pages = Pages(*free_lists(16, seed=1))
    batch = batch_of([pages], [(0, n)])
    h0 = target(seq[:n], batch.positions(), batch, kv)  # [n, hidden], an inference tensor
    assert h0.is_inference()
    toks = chain_tokens(seq, n)
    weight = hiddens(n, cfg.hidden_size, seed=3)

    def loss_of(outs: list[Tensor]) -> Tensor:
        return sum(((o * weight).sum() for o in outs), torch.zeros(()))

    h1 = heads.forward_layer_dense(0, toks[0], h0, target.embed, target.rope_tables)
    h2 = heads.forward_layer_dense(1, toks[1], h1, target.embed, target.rope_tables)
    loss_of([h1, h2]).backward()
    ours = {name: p.grad.clone() for name, p in heads.named_parameters() if p.grad is not None}
    heads.zero_grad(set_to_none=True)
    p0, p1 = (dict(h.named_parameters()) for h in heads.heads()[:2])
    r1 = ref_head(p0, cfg, target.embed(toks[0]), h0.clone())
    r2 = ref_head(p1, cfg, target.embed(toks[1]), r1)
    loss_of([r1, r2]).backward()
    used = [name for name, _ in heads.named_parameters() if name.startswith(("layers.0.", "layers.1."))]
    assert sorted(ours) == sorted(used)
    for name, p in heads.named_parameters():
        if name in ours:
            assert p.grad is not None and bool(p.grad.abs().sum() > 0), name
            assert torch.allclose(ours[name], p.grad, atol=1e-5, rtol=1e-4), name


# ---- paged vs dense ------------------------------------------------------------------------------

# Three steps per sequence of different sizes (300 and 200 rows): prefill chunks, then a last step
# that is a prefill chunk for one sequence and a single decode row for the other.
STEPS = [(100, 37), (149, 162), (51, 1)]
# A prefill in two chunks, then five single-row steps (drafting one position at a time).
DRAFT_STEPS = [(120, 90), (175, 105), (1, 1), (1, 1), (1, 1), (1, 1), (1, 1)]


def backends() -> list[tuple[str, bool]]:
    out = [("torch", False)]
    if cpu_attention.AVAILABLE:
        out += [("cpu", False), ("cpu", True)]  # the C paged kernel, and with fused q/k/v (one call)
    return out


def run_by(heads: MTPHeads, backend: str, fused: bool) -> MTPHeads:
    """``heads`` with attention ``backend``: "torch" and not ``fused``: as built (the torch
    reference, q/k/v unstacked); else a copy given the CPU backends with that attention, and with
    the layer backend when ``fused`` (the whole block in one call)."""
    if backend == "torch" and not fused:
        return heads
    heads = copy.deepcopy(heads)
    heads.after_load(
        select_backends("cpu", torch.float32, attention=backend, layer="cpu" if fused else "none")
    )
    return heads


@pytest.mark.parametrize(("backend", "fused"), backends())
def test_paged_equals_dense(
    cfg: DecoderConfig, target: DecoderForCausalLM, heads: MTPHeads, backend: str, fused: bool
) -> None:
    """Each head on its own inputs, two sequences in one batch over three steps, equals the dense
    path; the target's own KV layers are never touched (the heads write layers L .. L + D - 1)."""
    heads = run_by(heads, backend, fused)
    lens = [sum(s[b] for s in STEPS) for b in range(2)]
    assert lens == [300, 200]
    tokens = [torch.stack([ids(n, seed=100 * b + j) for j in range(NUM_HEADS)]) for b, n in enumerate(lens)]
    inputs = [
        torch.stack([hiddens(n, cfg.hidden_size, seed=100 * b + 50 + j) for j in range(NUM_HEADS)])
        for b, n in enumerate(lens)
    ]
    kv = mtp_kv(cfg, 48)
    paged = run_paged(heads, target, kv, tokens, inputs, STEPS, chain=False)
    for b in range(2):
        with torch.no_grad():
            dense = run_dense(heads, target, tokens[b], inputs[b], chain=False)
        assert torch.isfinite(paged[b]).all()
        assert torch.allclose(paged[b], dense, atol=ATOL, rtol=0), (b, (paged[b] - dense).abs().max())
    for i in range(cfg.num_hidden_layers):
        assert kv.layer(i).k.isnan().all() and kv.layer(i).v.isnan().all(), f"target layer {i} was written"
    for j in range(NUM_HEADS):
        assert (
            kv.layer(heads.kv_layer(j)).window is not None and not kv.layer(heads.kv_layer(j)).k.isnan().all()
        )


@pytest.mark.parametrize("backend", sorted({b for b, _ in backends()}))
def test_chained_drafting_equals_dense_chain(
    cfg: DecoderConfig, target: DecoderForCausalLM, heads: MTPHeads, backend: str
) -> None:
    """h^1 of head 0 fed to head 1 (and h^2 to head 2) within each step, as a draft chain runs,
    equals the dense chain; the last five steps are one row per sequence."""
    lens = [sum(s[b] for s in DRAFT_STEPS) for b in range(2)]
    seqs = [ids(n + NUM_HEADS, seed=40 + b) for b, n in enumerate(lens)]
    tokens = [chain_tokens(s, n) for s, n in zip(seqs, lens, strict=True)]
    inputs = [
        hiddens(n, cfg.hidden_size, seed=60 + b)[None].expand(NUM_HEADS, -1, -1) for b, n in enumerate(lens)
    ]
    heads = run_by(heads, backend, fused=False)
    paged = run_paged(heads, target, mtp_kv(cfg, 48), tokens, inputs, DRAFT_STEPS, chain=True)
    for b in range(2):
        with torch.no_grad():
            dense = run_dense(heads, target, tokens[b], inputs[b], chain=True)
        assert torch.allclose(paged[b], dense, atol=ATOL, rtol=0), (b, (paged[b] - dense).abs().max())
    # the chain is not the heads run on their own inputs: head 1 really read head 0's output
    with torch.no_grad():
        alone = heads.forward_layer_dense(1, tokens[0][1], inputs[0][1], target.embed, target.rope_tables)
    assert (alone - paged[0][1]).abs().max() > 1000 * ATOL


# ---- the MiMo-V2.5 release-layout fixture --------------------------------------------------------


@pytest.fixture(scope="module")
def mimo(mimo_v2_dir: Path) -> LoadedLLM:
    return load_llm(mimo_v2_dir)


def test_release_fixture_heads_run(mimo: LoadedLLM) -> None:
    """The loaded heads (fused qkv split by the loader; 8 q heads, 4 SWA KV heads of 96/64 dims,
    window 17) drafting from the target's hidden states: the target prefills into the same cache,
    the heads follow one row behind (they need t_{i+1}), dense and paged agree and are finite."""
    assert mimo.mtp is not None and mimo.mtp.num_layers == fx.NUM_MTP_LAYERS == NUM_HEADS
    model, config, heads = mimo.model, mimo.config, mimo.mtp
    n = 46
    assert n > 2 * config.sliding_window
    seq = ids(n, seed=9, vocab=config.vocab_size)
    kv = mtp_kv(config, 16)
    pages = Pages(*free_lists(16, seed=2))
    # the target over the whole prompt in two chunks (its hidden h^0 at every position)
    h0 = torch.cat(
        [
            model(seq[s:e], b.positions(), b, kv)
            for s, e in ((0, 20), (20, n))
            for b in [batch_of([pages], [(s, e)])]
        ]
    )
    rows = n - NUM_HEADS  # rows whose chain has every token: t_{i+3} exists
    tokens = chain_tokens(seq, rows)
    with torch.no_grad():
        dense = run_dense(heads, model, tokens, h0[None, :rows].expand(NUM_HEADS, -1, -1), chain=True)
    assert torch.isfinite(dense).all() and dense.shape == (NUM_HEADS, rows, config.hidden_size)
    # the heads' reference: head 0 equals the test's own math on the loaded weights
    ref = ref_head(
        dict(heads.heads()[0].named_parameters()), config, model.embed(tokens[0]), h0[:rows].clone()
    )
    assert torch.allclose(dense[0], ref, atol=ATOL, rtol=0), (dense[0] - ref).abs().max()
    # paged, in the same cache as the target, in three steps
    out: list[list[Tensor]] = [[] for _ in range(NUM_HEADS)]
    for s, e in ((0, 15), (15, 40), (40, rows)):
        batch = batch_of([pages], [(s, e)])
        positions = batch.positions()
        rope = model.rope_tables(positions, torch.float32)
        prev = h0[s:e]
        for j in range(NUM_HEADS):
            prev = heads.forward_layer(j, tokens[j, s:e], prev, positions, batch, kv, model.embed, rope)
            out[j].append(prev)
    paged = torch.stack([torch.cat(o) for o in out])
    # rtol too: three heads deep, outputs up to ~3, the two attention paths round differently
    assert torch.allclose(paged, dense, atol=ATOL, rtol=ATOL), (
        (paged - dense).abs().max(dim=-1).values.max(-1)
    )
    # the drafts are tokens of the vocabulary, from the target's lm_head
    logits = model.compute_logits(paged[:, -1])
    assert logits.shape == (NUM_HEADS, config.vocab_size) and torch.isfinite(logits).all()
