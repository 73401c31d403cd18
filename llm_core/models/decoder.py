"""DecoderForCausalLM: the MiMo-V2-Flash decoder (hybrid full/sliding-window attention, MoE) over a
packed, paged batch.

    tokens [T] -> embed -> L x (RMSNorm -> attention -> +res -> RMSNorm -> MLP/MoE -> +res)
           -> RMSNorm -> hidden [T, hidden]            compute_logits(hidden rows) -> [B, vocab]

Attention per layer type (see config.py):

    full layers   Hkv = num_key_value_heads,      theta = rope_theta,     all previous keys,
                  KV in the full pool (batch.full_slots / full_page_table)
    SWA layers    Hkv = swa_num_key_value_heads,  theta = swa_rope_theta, keys p-W+1..p + sinks,
                  KV in the SWA pool (batch.swa_slots / swa_page_table)

Values are scaled by ``attention_value_scale`` before they are cached, so the cache holds exactly
what attention reads. Attention reads the pools through the page tables in one call per layer,
prefill and decode alike (``attention.paged_attention``: the Triton kernels on CUDA, the C kernel
of ``cpu_attention`` on CPU, the torch reference where neither applies); rotary (cos, sin) rows
are gathered once per step for each (rope_dim, theta) from per-position tables the model keeps.
Layers hand on (mlp output, residual) so that each RMSNorm adds the residual itself.

On CPU in fp32, once ``fuse_weights`` has laid the weights out, each decoder layer of the paged
forward is one C call (``cpu_layer``: norms, projections through torch's BLAS or, for decode-sized
batches, strip-packed weight copies, rotary + KV store + attention, router and experts, on two
buffers updated in place); the modules below are the same computation step by step, used
elsewhere and as its reference (``layer_kernel = False``).
``forward_dense`` is the plain unpaged reference (one sequence, no cache).
Parameter names match transformers' in-memory module tree, so a converted state dict loads as is.
The model knows nothing about scheduling, sampling or where KV pages come from.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llm_core.kernels import cpu_attention, cpu_layer, cpu_norm
from llm_core.kernels.attention import masked_attention, paged_attention, write_kv
from llm_core.kernels.attention_batch import AttentionBatch, PagedKV
from llm_core.kernels.weight_layout import input_major
from llm_core.models.config import DecoderConfig
from llm_core.models.moe import DenseMLP, GroupedExperts, SparseMoE
from llm_core.models.rope import PartialRotary, apply_partial_rotary_, mrope_rows

# Rotary (cos, sin) tables of one step's positions, per (rope_dim, theta): gathered once per step
# by the model (``DecoderForCausalLM.rope_tables``) or made by the first layer that needs them, and
# reused by the other layers of its type.
RopeTables = dict[tuple[int, float], tuple[Tensor, Tensor]]

# Rows of the per-position rotary tables the model keeps (grown by doubling from this many).
ROPE_CACHE_MIN_POSITIONS = 1024


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if cpu_norm.supports(x, self.weight):
            return cpu_norm.rms_norm_cpu(x, self.weight, self.eps)[0]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one op instead of six; bit-identical to the expression below for fp32 (tested)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """The residual add before a pre-norm, then the norm: (norm(residual + x), residual + x).
        One kernel pass on CPU in fp32; fresh tensors either way."""
        if cpu_norm.supports(x, self.weight) and residual.dtype == torch.float32:
            normed, total = cpu_norm.rms_norm_cpu(x, self.weight, self.eps, residual)
            assert total is not None
            return normed, total
        total = residual + x
        return self(total), total


class MiMoAttention(nn.Module):
    """One attention layer (full or sliding window, by ``config.layer_types[layer_idx]``)."""

    def __init__(self, config: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.is_swa = not config.is_full_layer(layer_idx)
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
        # q, k and v weights stacked into one [(H + 2 Hkv') * ., hidden] matrix by ``fuse_weights``
        # (one matmul instead of three); None until then. Not saved: the checkpoint keeps the three.
        self.qkv_weight: Tensor | None
        self.qkv_bias: Tensor | None
        self.register_buffer("qkv_weight", None, persistent=False)
        self.register_buffer("qkv_bias", None, persistent=False)

    @torch.no_grad()
    def fuse_weights(self) -> None:
        """Stack q/k/v projections for the fused path (and store them, and o_proj, input-major: see
        ``weight_layout``); call again after the weights change."""
        self.qkv_weight = input_major(torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
        self.o_proj.weight.data = input_major(self.o_proj.weight.data)
        biases = [self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]
        self.qkv_bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])

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
        """x [T, hidden] -> q [T, H, D], k [T, Hkv, D] (rotated), v [T, Hkv, Dv] (value-scaled)."""
        n = x.shape[0]
        if self.qkv_weight is not None:
            return self._qkv_fused(x, positions, rope)
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.v_head_dim) * self.v_scale
        cos, sin = self._cos_sin(positions, q.dtype, rope)
        return apply_partial_rotary_(q, cos, sin), apply_partial_rotary_(k, cos, sin), v  # fresh tensors

    def _qkv_fused(
        self, x: Tensor, positions: Tensor, rope: RopeTables | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``_qkv`` with one matmul, and one rotary pass over q and k together (they are adjacent)::

        qkv row   [ q: H * D | k: Hkv * D | v: Hkv * Dv ]
                  [ rotated as H + Hkv heads ]
        """
        assert self.qkv_weight is not None
        n, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # [T, (H + Hkv) * D + Hkv * Dv]
        split = (heads + kv_heads) * dim
        qk = qkv[:, :split].view(n, heads + kv_heads, dim)
        v = qkv[:, split:].view(n, kv_heads, self.v_head_dim) * self.v_scale
        cos, sin = self._cos_sin(positions, x.dtype, rope)
        qk = apply_partial_rotary_(qk, cos, sin)  # [T, H + Hkv, D], in the qkv temporary
        return qk[:, :heads], qk[:, heads:], v

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        batch: AttentionBatch,
        kv: PagedKV,
        rope: RopeTables | None = None,
        backend: str | None = None,
    ) -> Tensor:
        """Paged: write this step's KV into the layer's pool, then attend. x [T, hidden] -> [T, hidden].

        ``backend``: see ``attention.paged_attention`` (None: chosen by device). With the CPU kernel
        and the fused projection, everything between the two projections is one kernel call
        (``cpu_attention.qkv_attention_cpu``: rotary, KV store and attention)."""
        layer_kv = kv.layer(self.layer_idx)
        assert layer_kv.is_swa == self.is_swa, f"layer {self.layer_idx}: KV pool type mismatch"
        slots = batch.swa_slots if self.is_swa else batch.full_slots
        table = batch.swa_page_table if self.is_swa else batch.full_page_table
        if (
            self.qkv_weight is not None
            and backend in (None, "cpu")
            and cpu_attention.supports(x, layer_kv.k, layer_kv.v)
        ):
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias)  # [T, (H + Hkv) * D + Hkv * Dv]
            cos, sin = self._cos_sin(positions, x.dtype, rope)
            out = cpu_attention.qkv_attention_cpu(
                qkv,
                cos,
                sin,
                slots,
                layer_kv.k,
                layer_kv.v,
                table,
                batch.cu_seqlens_q,
                batch.seq_lens,
                self.num_heads,
                self.scale,
                self.window,
                self.sinks,
                self.v_scale,
            )  # [T, H, Dv]
            return self.o_proj(out.view(x.shape[0], -1))
        q, k, v = self._qkv(x, positions, rope)
        write_kv(layer_kv.k, layer_kv.v, slots, k, v)
        out = paged_attention(
            q,
            layer_kv.k,
            layer_kv.v,
            table,
            batch.cu_seqlens_q,
            batch.seq_lens,
            batch.max_seqlen_q,
            self.scale,
            self.window,
            self.sinks,
            backend,
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

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        positions: Tensor,
        batch: AttentionBatch | None,
        kv: PagedKV | None,
        rope: RopeTables | None = None,
        backend: str | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(x, residual) -> (mlp output, residual): the hidden state after the layer is their sum,
        left for the next norm to add (fused with it). The first layer takes the embeddings as x and
        residual None::

            residual = residual + x;  h = attn(norm1(residual))
            residual = residual + h;  return mlp(norm2(residual)), residual
        """
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        if batch is None:
            h = self.self_attn.forward_dense(h, positions, rope)
        else:
            assert kv is not None
            h = self.self_attn(h, positions, batch, kv, rope, backend)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual

    def kernel_weights(self) -> cpu_layer.LayerWeights | None:
        """This layer's weights for the one-call CPU kernel (``cpu_layer``), or None when it cannot
        run them (weights not fused, not fp32 on CPU, kernel not built)."""
        attn, mlp = self.self_attn, self.mlp
        if attn.qkv_weight is None or self.input_layernorm.eps != self.post_attention_layernorm.eps:
            return None
        if isinstance(mlp, SparseMoE):
            gate = mlp.gate
            mlp_args = cpu_layer.moe_args(
                gate.weight,
                gate.e_score_correction_bias,
                mlp.experts.gate_up_proj,
                mlp.experts.down_proj,
                gate.top_k,
                gate.n_group,
                gate.topk_group,
                gate.norm_topk_prob,
                gate.scaling,
            )
        else:
            assert isinstance(mlp, DenseMLP)
            if mlp.gate_up_weight is None:
                return None
            mlp_args = cpu_layer.dense_mlp_args(mlp.gate_up_weight, mlp.down_proj.weight)
        if mlp_args is None:
            return None
        return block_kernel_weights(self.input_layernorm, self.post_attention_layernorm, attn, mlp_args)


def block_kernel_weights(
    ln1: RMSNorm, ln2: RMSNorm, attn: MiMoAttention, mlp_args: cpu_layer.MlpArgs
) -> cpu_layer.LayerWeights | None:
    """The one-call CPU kernel's arguments for a pre-norm block (norm, attention, residual, norm,
    MLP, residual): a decoder layer, or an MTP head's block. ``attn`` must be fused."""
    assert attn.qkv_weight is not None
    return cpu_layer.layer_weights(
        ln1.weight,
        ln2.weight,
        ln1.eps,
        attn.qkv_weight,
        attn.qkv_bias,
        attn.o_proj.weight,
        attn.sinks,
        attn.num_heads,
        attn.num_kv_heads,
        attn.head_dim,
        attn.v_head_dim,
        attn.window,
        attn.scale,
        attn.v_scale,
        mlp_args,
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
        # Attention backend of the paged forward ("triton", "cpu", "torch"; see
        # attention.paged_attention); None: chosen by device and dtype.
        self.attention_backend: str | None = None
        # Run each layer of the paged forward as one C call where it can (``cpu_layer``); False:
        # always the modules. The layers' kernel weights are taken by ``fuse_weights``.
        self.layer_kernel = True
        self._kernel_weights: list[cpu_layer.LayerWeights] | None = None
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

    def fuse_weights(self) -> None:
        """Build the stacked projection weights the fused paths use (see ``MiMoAttention``,
        ``DenseMLP``) and store projection weights input-major (``weight_layout``; the lm_head too,
        unless it is the embedding). Call after loading weights, and again after any later change
        to them."""
        for module in self.modules():
            if isinstance(module, (MiMoAttention, DenseMLP, GroupedExperts)):
                module.fuse_weights()
        if self.lm_head.weight is not self.model.embed_tokens.weight:  # lookups want rows contiguous
            self.lm_head.weight.data = input_major(self.lm_head.weight.data)
        weights = [layer.kernel_weights() for layer in self.model.decoder_layers()]
        self._kernel_weights = (
            None if any(w is None for w in weights) else [w for w in weights if w is not None]
        )

    def _layer_kernel_weights(self, x: Tensor) -> list[cpu_layer.LayerWeights] | None:
        """The layers' kernel weights when this paged forward runs one C call per layer, else None
        (switched off, another attention backend, not fp32 on CPU, or weights changed since
        ``fuse_weights``: e.g. the model moved, which replaces the fused tensors)."""
        weights = self._kernel_weights
        if (
            weights is None
            or not self.layer_kernel
            or self.attention_backend not in (None, "cpu")
            or x.device.type != "cpu"
            or x.dtype != torch.float32
            or any(w.source is not attn.qkv_weight for w, attn in zip(weights, self._attentions, strict=True))
        ):
            return None
        return weights

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

        Writes every layer's KV for the T new tokens at batch.full_slots / batch.swa_slots before
        attending, so a later step (or a later prefill chunk) reads them from the pools.
        ``input_embeds`` [T, hidden], when given, replaces the token embedding lookup.
        """
        x = self.embed(input_ids) if input_embeds is None else input_embeds
        assert x.shape[0] == positions.shape[-1] == batch.num_tokens, "tokens, positions, slots disagree"
        assert positions.dim() == (2 if self.config.mrope_section else 1), "M-RoPE takes [3, T] positions"
        rope = self.rope_tables(positions, x.dtype)
        kernel_weights = self._layer_kernel_weights(x)
        if kernel_weights is not None:
            # x: a fresh embedding, or a copy of the caller's (the kernel updates it in place)
            x = x.contiguous() if input_embeds is None else x.clone(memory_format=torch.contiguous_format)
            return self._forward_kernel(x, rope, batch, kv, kernel_weights)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, positions, batch, kv, rope, self.attention_backend)
        return self._final_norm(x, residual)

    def _forward_kernel(
        self,
        x: Tensor,
        rope: RopeTables,
        batch: AttentionBatch,
        kv: PagedKV,
        kernel_weights: list[cpu_layer.LayerWeights],
    ) -> Tensor:
        """``forward`` with one C call per layer; x [T, hidden] (contiguous, ours to overwrite) and a
        residual buffer are updated in place by every layer."""
        residual = torch.empty_like(x)
        cpu_layer.set_threads(torch.get_num_threads())
        step = cpu_layer.StepArgs(batch)
        for i, (attn, weights) in enumerate(zip(self._attentions, kernel_weights, strict=True)):
            layer_kv = kv.layer(i)
            assert layer_kv.is_swa == attn.is_swa, f"layer {i}: KV pool type mismatch"
            cos, sin = rope[attn.rotary.key]
            cpu_layer.decoder_layer_cpu(weights, step, layer_kv, cos, sin, x, residual, first=i == 0)
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
        """hidden [B, hidden] (e.g. the last new token of each sequence) -> logits [B, vocab] (fp32)."""
        return F.linear(hidden, self.lm_head.weight).float()

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
        for layer in self.model.layers:
            x, residual = layer(x, residual, positions, None, None, rope)
        return self.compute_logits(self._final_norm(x, residual))[None]
