"""DecoderForCausalLM: the MiMo-V2-Flash decoder (hybrid full/sliding-window attention, MoE) over a
packed, paged batch.

    tokens [T] -> embed -> L x (RMSNorm -> attention -> +res -> RMSNorm -> MLP/MoE -> +res)
           -> RMSNorm -> hidden [T, hidden]            compute_logits(hidden rows) -> [B, vocab]

Attention per layer type (see config.py):

    full layers   Hkv = num_key_value_heads,      theta = rope_theta,     all previous keys,
                  KV in the full-attention group's pool
    SWA layers    Hkv = swa_num_key_value_heads,  theta = swa_rope_theta, keys p-W+1..p + sinks,
                  KV in the sliding-window group's pool (each layer reads its group's
                  batch.slots / batch.page_tables entry: ``kv.layer(i).group``)

Values are scaled by ``attention_value_scale`` before they are cached, so the cache holds exactly
what attention reads. Rotary (cos, sin) rows are gathered once per step for each (rope_dim, theta)
from per-position tables the model keeps. Layers hand on (mlp output, residual) so that each
RMSNorm adds the residual itself.

Which kernels run is not decided here: ``after_load`` takes the engine's ``Backends``
(``llm_core.backends``; by default chosen for the weights' device and dtype) and gives each module
its backend, whose pack hook lays the module's weights out for its kernels. The attention backend
runs each layer's attention between its projections over the pools (one call per layer, prefill
and decode alike); the MoE and norm backends run the router, the experts and the norms. A layer
backend that supports a whole layer (the CPU kernel: norms, projections, rotary + KV store +
attention, router and experts in one C call on two buffers updated in place) is offered each
layer's parameters; each layer hands its whole paged forward to one runner, that backend when it
took the layer, else the modules runner (``module_block``). The paged path reads the packed
weights only (q/k/v and gate/up stacked at load); ``forward_dense`` is the plain unpaged
reference (one sequence, no cache) over the modules' own weights.
Parameter names match transformers' in-memory module tree, so a converted state dict loads as is.
The model knows nothing about scheduling, sampling or where KV pages come from.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llm_core.backends.attention import AttentionBackend
from llm_core.backends.layer import (
    BlockParams,
    BlockRunner,
    DenseMlpParams,
    LayerStep,
    MoEParams,
    PackedLayer,
)
from llm_core.backends.norm import NormBackend
from llm_core.backends.selector import Backends, reference_backends, select_backends
from llm_core.backends.specs import AttentionSpec
from llm_core.kernels.attention import masked_attention
from llm_core.kernels.attention_batch import AttentionBatch, LayerKVLike, PagedKV
from llm_core.kernels.weight_layout import input_major
from llm_core.models.config import DecoderConfig
from llm_core.models.module_block import MODULES, ModuleBlock
from llm_core.models.moe import DenseMLP, SparseMoE
from llm_core.models.rope import PartialRotary, apply_partial_rotary_, mrope_rows

# Rotary (cos, sin) tables of one step's positions, per (rope_dim, theta): gathered once per step
# by the model (``DecoderForCausalLM.rope_tables``) or made by the first layer that needs them, and
# reused by the other layers of its type.
RopeTables = dict[tuple[int, float], tuple[Tensor, Tensor]]

# Rows of the per-position rotary tables the model keeps (grown by doubling from this many).
ROPE_CACHE_MIN_POSITIONS = 1024

# What every module runs until ``after_load`` gives it the engine's choice: the torch reference.
REFERENCE: Backends = reference_backends()


class RMSNorm(nn.Module):
    """RMSNorm through its norm backend (``backends.norm``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.backend: NormBackend = REFERENCE.norm

    def forward(self, x: Tensor) -> Tensor:
        return self.backend.norm(x, self.weight, self.eps)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """The residual add before a pre-norm, then the norm: (norm(residual + x), residual + x).
        Fresh tensors."""
        return self.backend.add_norm(x, residual, self.weight, self.eps)


class MiMoAttention(nn.Module):
    """One attention layer (full or sliding window, by ``config.layer_types[layer_idx]``)."""

    def __init__(self, config: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_kv_heads(layer_idx)
        self.head_dim = config.head_dim
        self.v_head_dim = config.v_head_dim
        self.window = config.window(layer_idx)
        self.scale = config.head_dim**-0.5
        self.v_scale = config.attention_value_scale
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.v_head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, hidden, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.has_sinks(layer_idx) else None
        self.rotary = PartialRotary(config.rope_dim(layer_idx), config.rope_theta_of(layer_idx))
        self.spec = AttentionSpec(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.v_head_dim,
            self.window,
            self.scale,
            self.v_scale,
        )
        self.backend: AttentionBackend = REFERENCE.attention
        # q, k and v weights stacked into one [(H + 2 Hkv') * ., hidden] matrix by the backend's
        # pack hook (``after_load``; one matmul instead of three); None until then. Not saved: the
        # checkpoint keeps the three.
        self.qkv_weight: Tensor | None
        self.qkv_bias: Tensor | None
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)

    @torch.no_grad()
    def after_load(self, backend: AttentionBackend) -> None:
        """Take ``backend`` and the weight layout its pack hook gives (q/k/v stacked, o_proj
        input-major: ``backends.layout``); call again after the weights change."""
        packed = backend.pack_attention(
            self.q_proj.weight,
            self.k_proj.weight,
            self.v_proj.weight,
            self.o_proj.weight,
            self.q_proj.bias,
            self.k_proj.bias,
            self.v_proj.bias,
        )
        self.backend = backend
        self.qkv_weight, self.qkv_bias = packed.qkv_weight, packed.qkv_bias
        self.o_proj.weight.data = packed.o_weight

    def _cos_sin(
        self, positions: Tensor, dtype: torch.dtype, rope: RopeTables | None
    ) -> tuple[Tensor, Tensor]:
        rot = self.rotary
        if rope is None:
            return rot.cos_sin(positions, dtype)
        key = rot.key
        if key not in rope:
            rope[key] = rot.cos_sin(positions, dtype)
        return rope[key]

    def _qkv(
        self, x: Tensor, positions: Tensor, rope: RopeTables | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x [T, hidden] -> q [T, H, D], k [T, Hkv, D] (rotated), v [T, Hkv, Dv] (value-scaled), by
        the modules' own projections (the dense reference's)."""
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.v_head_dim) * self.v_scale
        cos, sin = self._cos_sin(positions, q.dtype, rope)
        return apply_partial_rotary_(q, cos, sin), apply_partial_rotary_(k, cos, sin), v  # fresh tensors

    def qkv_rows(self, x: Tensor) -> Tensor:
        """x [T, hidden] -> qkv [T, (H + Hkv) * D + Hkv * Dv] (contiguous, a temporary of ours), by
        the stacked projection ``after_load`` packed."""
        assert self.qkv_weight is not None, "a paged forward needs after_load's packed weights"
        return F.linear(x, self.qkv_weight, self.qkv_bias)

    def forward_paged(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv: LayerKVLike, batch: AttentionBatch
    ) -> Tensor:
        """Write this step's KV into the layer's pages (``kv``: this layer's), then attend:
        x [T, hidden] -> [T, hidden]. Everything between the two projections is the attention
        backend's (rotary, KV store, attention)."""
        slots, table = batch.slots[kv.group], batch.page_tables[kv.group]
        out = self.backend.forward(
            self.spec, self.qkv_rows(x), cos, sin, self.sinks, kv, slots, table, batch
        )  # [T, H, Dv]
        return self.o_proj(out.reshape(x.shape[0], -1))

    def forward_dense(self, x: Tensor, positions: Tensor, rope: RopeTables | None = None) -> Tensor:
        """Reference: one sequence x [S, hidden] at ``positions`` [S], no cache -> [S, hidden]
        (``rope``: this sequence's cos/sin when they are not its 1-D positions', e.g. M-RoPE)."""
        q, k, v = self._qkv(x, positions, rope)
        out = masked_attention(q, k, v, positions, positions, self.scale, self.window, self.sinks)
        return self.o_proj(out.reshape(x.shape[0], -1))


class MiMoDecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MiMoAttention(config, layer_idx)
        self.mlp: nn.Module
        if config.is_moe_layer(layer_idx):
            self.mlp = SparseMoE(config)
        else:
            self.mlp = DenseMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # What runs this layer's paged forward, and what it runs it with (``after_load``): the layer
        # backend and its packed block when it took the layer, else the modules runner.
        self.runner: BlockRunner = MODULES
        self.block: PackedLayer = self.module_block()
        # What that path reads every step, as plain attributes (a submodule lookup costs ~0.3 us).
        self._kv_layer, self._window = layer_idx, self.self_attn.window
        self._rope_key = self.self_attn.rotary.key

    def module_block(self) -> ModuleBlock:
        """This layer as the modules runner runs it."""
        mlp = self.mlp
        assert isinstance(mlp, (SparseMoE, DenseMLP))
        return ModuleBlock(
            self.input_layernorm, self.self_attn, self.post_attention_layernorm, mlp.forward_packed
        )

    def run_modules(self) -> None:
        """Run this layer's paged forward as its modules (what ``after_load`` does when no layer
        backend takes it)."""
        self.runner, self.block = MODULES, self.module_block()

    def after_load(self, backends: Backends) -> None:
        """Give the modules their backends (which lay out their weights), then offer the layer to
        the layer backend: its runner from now on when it takes it, else the modules runner."""
        self.input_layernorm.backend = backends.norm
        self.post_attention_layernorm.backend = backends.norm
        self.self_attn.after_load(backends.attention)
        mlp = self.mlp
        assert isinstance(mlp, (SparseMoE, DenseMLP))
        mlp.after_load(backends.moe)
        params = self.block_params()
        packed = None if params is None else backends.layer.pack(params)
        if packed is None:
            self.run_modules()
        else:
            self.runner, self.block = backends.layer, packed

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        positions: Tensor,
        batch: AttentionBatch,
        kv: PagedKV,
        rope: RopeTables | None,
        step: LayerStep,
    ) -> tuple[Tensor, Tensor]:
        """Paged: (x, residual) -> (mlp output, residual), whose sum is the hidden state after the
        layer, left for the next norm to add (fused with it); the first layer takes the embeddings
        as x and residual None::

            residual = residual + x;  h = attn(norm1(residual))
            residual = residual + h;  return mlp(norm2(residual)), residual

        The whole block is the runner's (one call, with ``step``: its ``begin(batch)``)."""
        layer_kv = kv.layer(self._kv_layer)
        assert layer_kv.window == self._window, f"layer {self._kv_layer}: its KV group's window differs"
        key = self._rope_key
        cos, sin = (
            rope[key]
            if rope is not None and key in rope
            else self.self_attn._cos_sin(positions, x.dtype, rope)
        )
        return self.runner.forward(self.block, step, layer_kv, cos, sin, x, residual)

    def forward_dense(
        self, x: Tensor, residual: Tensor | None, positions: Tensor, rope: RopeTables | None = None
    ) -> tuple[Tensor, Tensor]:
        """The reference of ``forward``: one sequence, no cache, the modules' own weights."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn.forward_dense(h, positions, rope)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual

    def block_params(self) -> BlockParams | None:
        """This layer's parameters as a layer backend takes them (after ``after_load`` packed them),
        or None when its two norms' eps differ."""
        mlp = self.mlp
        mlp_params: DenseMlpParams | MoEParams
        if isinstance(mlp, SparseMoE):
            gate, experts = mlp.gate, mlp.experts
            mlp_params = MoEParams(
                gate.weight, gate.e_score_correction_bias, experts.gate_up_proj, experts.down_proj, gate.spec
            )
        else:
            assert isinstance(mlp, DenseMLP) and mlp.gate_up_weight is not None, "packed by after_load"
            mlp_params = DenseMlpParams(mlp.gate_up_weight, mlp.down_proj.weight)
        return block_params(self.input_layernorm, self.post_attention_layernorm, self.self_attn, mlp_params)


def block_params(
    ln1: RMSNorm, ln2: RMSNorm, attn: MiMoAttention, mlp: DenseMlpParams | MoEParams
) -> BlockParams | None:
    """A pre-norm block's parameters (norm, attention, residual, norm, MLP, residual: a decoder
    layer, or an MTP head's block) for a layer backend, after ``after_load`` packed them; None when
    the norms' eps differ."""
    assert attn.qkv_weight is not None, "packed by after_load"
    if ln1.eps != ln2.eps:
        return None
    return BlockParams(
        ln1.weight,
        ln2.weight,
        ln1.eps,
        attn.qkv_weight,
        attn.qkv_bias,
        attn.o_proj.weight,
        attn.sinks,
        attn.spec,
        mlp,
    )


class MiMoModel(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MiMoDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def decoder_layers(self) -> list[MiMoDecoderLayer]:
        """The layers, typed (iterating an nn.ModuleList gives plain Modules)."""
        return cast(list[MiMoDecoderLayer], list(self.layers))


class DecoderForCausalLM(nn.Module):
    """MiMo-V2-Flash causal LM. Paged ``forward`` for serving, ``forward_dense`` as the reference."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.model = MiMoModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # What runs the kernels (``after_load``); the torch reference until then.
        self.backends: Backends = REFERENCE
        # The layers' runners, each once (``after_load``): every step begins each, and the first
        # layer's takes the hidden input; ``_runner_of[i]``: layer i's index among them.
        self._runners: list[BlockRunner] = [MODULES]
        self._runner_of: list[int] = [0] * config.num_hidden_layers
        # (cos, sin) fp32 [positions, width] per (rope_dim, theta), for positions 0 .. n - 1: a step
        # gathers its rows instead of computing its angles (~10 small ops per layer type and step).
        self._rope_cache: dict[tuple[int, float], tuple[Tensor, Tensor]] = {}
        # Each layer's attention module, and one rotary per (rope_dim, theta): fixed once built,
        # looked up once (a step would walk the module tree for them, ~10 us per pass).
        self._attentions: list[MiMoAttention] = [layer.self_attn for layer in self.model.decoder_layers()]
        self._rotaries = list({a.rotary.key: a.rotary for a in self._attentions}.values())

    def tie_weights(self) -> None:
        """Share lm_head with the token embedding when the config ties them. Call again after
        anything that re-materialises parameters (``to_empty``, dtype/device moves)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def after_load(self, backends: Backends | None = None) -> Backends:
        """The after-load hook: take ``backends`` (default: ``select_backends`` for the weights'
        device and dtype), give every module its backend, whose pack hook lays out the module's
        weights for its kernels, and offer each layer to the layer backend; the lm_head is stored
        input-major (``weight_layout``) unless it is the embedding. Call after loading weights, and
        again after any later change to them or move of the model. Returns the backends."""
        if backends is None:
            weight = self.model.embed_tokens.weight
            backends = select_backends(weight.device, weight.dtype)
        self.backends = backends
        self.model.norm.backend = backends.norm
        layers = self.model.decoder_layers()
        for layer in layers:
            layer.after_load(backends)
        if self.lm_head.weight is not self.model.embed_tokens.weight:  # lookups want rows contiguous
            self.lm_head.weight.data = input_major(self.lm_head.weight.data)
        taken = [layer.runner is not MODULES for layer in layers]
        if any(taken) and not all(taken) and self.model.embed_tokens.weight.dtype != torch.float32:
            # the layer backend computes in float32, modules in the weights' dtype: one or the other
            for layer in layers:
                layer.run_modules()
        self.set_runners()
        return backends

    def set_runners(self) -> None:
        """Record the layers' runners (after ``after_load``, or after a layer's runner changed)."""
        runners = [layer.runner for layer in self.model.decoder_layers()]
        # a layer backend first: the first layer's input is then the one it computes on
        self._runners = sorted(set(runners), key=lambda r: r is MODULES)
        self._runner_of = [self._runners.index(r) for r in runners]

    def embed(self, input_ids: Tensor) -> Tensor:
        """input_ids [T] -> [T, hidden]; the runner overwrites placeholder rows with media embeddings."""
        return self.model.embed_tokens(input_ids)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        batch: AttentionBatch,
        kv: PagedKV,
        input_embeds: Tensor | None = None,
    ) -> Tensor:
        """Packed paged step: input_ids [T], positions [T] (or [3, T] for an M-RoPE model: temporal,
        height, width) -> final-normed hidden [T, hidden].

        Writes every layer's KV for the T new tokens at its group's batch.slots before
        attending, so a later step (or a later prefill chunk) reads them from the pools.
        ``input_embeds`` [T, hidden], when given, replaces the token embedding lookup.
        """
        x = self.embed(input_ids) if input_embeds is None else input_embeds
        assert x.shape[0] == positions.shape[-1] == batch.num_tokens, "tokens, positions, slots disagree"
        assert positions.dim() == (2 if self.config.mrope_section else 1), "M-RoPE takes [3, T] positions"
        # the hidden state the runners compute on (a layer backend: float32 it may overwrite; the
        # embedding lookup is a temporary of ours, input embeddings are the caller's)
        x = self._runners[0].hidden_input(x, owned=input_embeds is None)
        rope = self.rope_tables(positions, x.dtype)
        steps = [runner.begin(batch) for runner in self._runners]
        residual = None
        for layer, k in zip(self.model.layers, self._runner_of, strict=True):
            x, residual = layer(x, residual, positions, batch, kv, rope, steps[k])
        return self._final_norm(x, residual)

    def rope_tables(self, positions: Tensor, dtype: torch.dtype) -> RopeTables:
        """This step's (cos, sin) [T, width] for every rotary configuration of the model: rows of
        per-position tables, computed by ``PartialRotary.cos_sin`` for positions 0 .. n - 1 when a
        position first reaches n (n doubling), then gathered. With M-RoPE, ``positions`` is [3, T]
        and each column takes the row of its section's axis (``mrope_rows``)."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        tables: RopeTables = {}
        for rot in self._rotaries:
            key = rot.key
            cached = self._rope_cache.get(key)
            if cached is None or cached[0].shape[0] < need or cached[0].device != positions.device:
                n = max(ROPE_CACHE_MIN_POSITIONS, 1 << (need - 1).bit_length())
                cached = self._rope_cache[key] = rot.cos_sin(
                    torch.arange(n, device=positions.device), torch.float32
                )
            cos, sin = cached
            if positions.dim() == 2:
                section = self.config.mrope_section
                tables[key] = (
                    mrope_rows(cos, positions, section).to(dtype),
                    mrope_rows(sin, positions, section).to(dtype),
                )
            else:
                tables[key] = (
                    cos.index_select(0, positions).to(dtype),
                    sin.index_select(0, positions).to(dtype),
                )
        return tables

    def _final_norm(self, x: Tensor, residual: Tensor | None) -> Tensor:
        """The last layer's (mlp output, residual) -> final-normed hidden state."""
        return self.model.norm(x) if residual is None else self.model.norm.add_forward(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [B, hidden] (e.g. the last new token of each sequence) -> logits [B, vocab] (fp32).
        The product runs in the lm_head's dtype (bf16 weights: hidden rounded to bf16 first)."""
        w = self.lm_head.weight
        return F.linear(hidden.to(w.dtype), w).float()

    @torch.inference_mode()
    def forward_dense(
        self, input_ids: Tensor, input_embeds: Tensor | None = None, rope_positions: Tensor | None = None
    ) -> Tensor:
        """Reference path without paging: input_ids [1, S] -> logits [1, S, vocab] (fp32).
        ``rope_positions`` [3, S]: M-RoPE positions (default: token i at i on every axis)."""
        assert input_ids.dim() == 2 and input_ids.shape[0] == 1, "forward_dense takes one sequence [1, S]"
        ids = input_ids[0]
        x = self.embed(ids) if input_embeds is None else input_embeds.reshape(ids.shape[0], -1)
        positions = torch.arange(ids.shape[0], device=ids.device)
        if rope_positions is None and self.config.mrope_section:
            rope_positions = positions[None].expand(3, -1)
        rope = None if rope_positions is None else self.rope_tables(rope_positions, x.dtype)
        residual = None
        for layer in self.model.decoder_layers():
            x, residual = layer.forward_dense(x, residual, positions, rope)
        return self.compute_logits(self._final_norm(x, residual))[None]
