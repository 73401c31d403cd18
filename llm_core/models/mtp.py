"""Multi-token-prediction heads (MiMo-V2.5's ``model.mtp.layers.{i}``, DeepSeek-V3's NextN style).

Loaded and shape-checked with the language model; run for speculative drafting (``forward_layer``,
paged) and for training and checks (``forward_layer_dense``, one sequence, autograd-safe). Head j
at position i takes the previous hidden state h^j_i (h^0: the target's final-normed hidden) and the
embedding of token t_{i+j+1} (embedding and lm_head are the model's)::

    x        = eh_proj(cat(enorm(embed(t_{i+j+1})), hnorm(h^j_i)))  [T, 2 * hidden] -> [T, hidden]
    x       += self_attn(input_layernorm(x))     a sliding-window layer (swa_* heads, sinks), rotary
                                                 position i, over head j's own KV at positions <= i
    x       += mlp(pre_mlp_layernorm(x))         dense SwiGLU, intermediate_size
    h^{j+1}_i = final_layernorm(x)               -> the model's lm_head predicts t_{i+j+2}

Head j's paged KV is an extra SWA layer of the target's cache, index ``num_hidden_layers + j``
(``KVLayout.from_model_config(..., mtp_layers=D)``), under the same SWA page table and slots as the
target's SWA layers. The heads reuse the target's SWA rotary settings, window and sinks, and the
same attention code as the target's SWA layers (``MiMoAttention``), so only the position
scheme's 1-D positions are supported (no M-RoPE).

State-dict names (the checkpoint's, less ``model.mtp.``; a fused ``qkv_proj`` is split by the
family's converter): ``layers.{i}.{enorm,hnorm,eh_proj,input_layernorm,pre_mlp_layernorm,
final_layernorm}.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.sinks``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``. The checkpoint does not say how many heads it has
(MiMo ships 3): the loader counts them in the tensor names (``num_layers_in``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from epd_common.runtime import torch_threads
from llm_core.backends.layer import BlockRunner, DenseMlpParams, PackedLayer
from llm_core.backends.selector import Backends
from llm_core.kernels.attention_batch import AttentionBatch, PagedKV
from llm_core.models.config import SLIDING, DecoderConfig
from llm_core.models.decoder import MiMoAttention, RMSNorm, RopeTables, block_params
from llm_core.models.module_block import MODULES, ModuleBlock
from llm_core.models.moe import DenseMLP

# At most this many rows, a head's input mix runs on one torch thread (``MTPHeads.forward_layer``).
SMALL_MIX_ROWS = 64

# Prefix of the heads' tensors in the loader's state dict (what a family's tensor_name maps them to).
MTP_PREFIX = "mtp."
_LAYER = re.compile(r"^layers\.(\d+)\.")

# The target's token embedding (``DecoderForCausalLM.embed``): ids [T] -> [T, hidden].
Embed = Callable[[Tensor], Tensor]
# The target's rotary tables (``DecoderForCausalLM.rope_tables``): (positions [T], dtype) -> tables.
RopeTablesFn = Callable[[Tensor, torch.dtype], RopeTables]


class MTPFormatError(ValueError):
    """MTP tensor names that do not describe heads 0 .. n-1; names the tensor."""


def head_config(config: DecoderConfig) -> DecoderConfig:
    """The config of one head's decoder layer: a single sliding-window layer with a dense MLP."""
    # the first windowed layer's window: the heads' KV joins its group (``kv_groups``)
    first_window = next(w for i in range(config.num_hidden_layers) if (w := config.window(i)) is not None)
    return dataclasses.replace(
        config,
        num_hidden_layers=1,
        layer_types=(SLIDING,),
        layer_windows=(first_window,),
        mlp_layer_types=("dense",),
    )


class MTPAttention(MiMoAttention):
    """A head's attention: built as layer 0 of ``head_config`` (so SLIDING: swa KV heads, window, sinks,
    SWA rotary), but reading and writing KV layer ``kv_layer`` of the cache, i.e. one of the SWA
    layers appended after the target's (``MiMoAttention.forward`` addresses ``kv.layer(layer_idx)``;
    built as index 0 it would overwrite the target's layer 0)."""

    def __init__(self, config: DecoderConfig, kv_layer: int) -> None:
        super().__init__(head_config(config), 0)
        assert self.window is not None
        self.layer_idx = kv_layer


class MTPLayer(nn.Module):
    def __init__(self, config: DecoderConfig, kv_layer: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = MTPAttention(config, kv_layer)
        self.pre_mlp_layernorm = RMSNorm(hidden, eps)
        self.mlp = DenseMLP(hidden, config.intermediate_size)
        self.final_layernorm = RMSNorm(hidden, eps)

    def mix(self, embeds: Tensor, prev_hidden: Tensor) -> Tensor:
        """embeds [T, hidden] (of the tokens t_{i+j+1}), prev_hidden [T, hidden] (h^j) -> x [T, hidden].
        Embedding first, hidden second (the agreed order, as in DeepSeek-V3's NextN heads). Runs in
        the embeddings' dtype (the target's layer backend hands a float32 h^j beside bf16 weights)."""
        prev_hidden = prev_hidden.to(embeds.dtype)
        return self.eh_proj(torch.cat([_norm(self.enorm, embeds), _norm(self.hnorm, prev_hidden)], dim=-1))

    def module_block(self) -> ModuleBlock:
        """The block between ``mix`` and ``final_layernorm`` as the modules runner runs it."""
        return ModuleBlock(
            self.input_layernorm, self.self_attn, self.pre_mlp_layernorm, self.mlp.forward_packed
        )

    def after_load(self, backends: Backends) -> tuple[BlockRunner, PackedLayer]:
        """Give the modules their backends (which lay out their weights), then offer the block
        between ``mix`` and ``final_layernorm`` (norm, window attention, norm, dense MLP, both
        residuals: a target decoder layer's shape) to the layer backend; returns what runs the
        block and what with: the layer backend when it took it, else the modules runner."""
        for norm in (
            self.enorm,
            self.hnorm,
            self.input_layernorm,
            self.pre_mlp_layernorm,
            self.final_layernorm,
        ):
            norm.backend = backends.norm
        self.self_attn.after_load(backends.attention)
        self.mlp.after_load(backends.moe)
        mlp = self.mlp
        assert mlp.gate_up_weight is not None, "packed by after_load"
        params = block_params(
            self.input_layernorm,
            self.pre_mlp_layernorm,
            self.self_attn,
            DenseMlpParams(mlp.gate_up_weight, mlp.down_proj.weight),
        )
        packed = None if params is None else backends.layer.pack(params)
        return (MODULES, self.module_block()) if packed is None else (backends.layer, packed)

    def finish(self, x: Tensor, attn: Tensor) -> Tensor:
        """x [T, hidden] (the block input), attn [T, hidden] (its attention output) -> h^{j+1}."""
        x = x + attn
        x = x + self.mlp(_norm(self.pre_mlp_layernorm, x))
        return _norm(self.final_layernorm, x)


def _norm(norm: RMSNorm, x: Tensor) -> Tensor:
    """``norm(x)``, through a differentiable op when autograd records: RMSNorm's CPU fp32 path is a C
    kernel whose output has no grad_fn (gradients would silently stop there)."""
    w = norm.weight
    if not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return norm(x)
    if x.dtype == w.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, norm.eps)
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)


def _plain(t: Tensor) -> Tensor:
    """``t``, or a normal copy of it when it was made in inference mode (e.g. the target's hidden
    states from its ``forward``) and we are outside it: autograd cannot save inference tensors."""
    return t.clone() if t.is_inference() and not torch.is_inference_mode_enabled() else t


class MTPHeads(nn.Module):
    """``num_layers`` heads (see the module docstring). Head j's KV is cache layer
    ``config.num_hidden_layers + j``."""

    def __init__(self, config: DecoderConfig, num_layers: int) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(MTPLayer(config, config.num_hidden_layers + j) for j in range(num_layers))
        # What runs each head's block in a paged forward, and what with (``after_load``).
        self._blocks: list[tuple[BlockRunner, PackedLayer]] = [
            (MODULES, h.module_block()) for h in self.heads()
        ]

    def heads(self) -> list[MTPLayer]:
        return cast(list[MTPLayer], list(self.layers))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def kv_layer(self, j: int) -> int:
        """The KV cache layer index of head ``j``."""
        return self.config.num_hidden_layers + j

    def after_load(self, backends: Backends) -> None:
        """The after-load hook (as the target's ``DecoderForCausalLM.after_load``; pass the target's
        backends). Only for serving: the packed copies it makes go stale when the weights change,
        so call it again after any change, and not while training."""
        self._blocks = [head.after_load(backends) for head in self.heads()]

    def _head(self, j: int, rope: RopeTables | None) -> MTPLayer:
        assert 0 <= j < len(self.layers), f"MTP head {j} of {len(self.layers)}"
        assert not self.config.mrope_section, "MTP heads run on 1-D positions only (no M-RoPE)"
        head = self.heads()[j]
        key = head.self_attn.rotary.key
        assert rope is None or key in rope, (
            f"MTP rotary {key} is not among the target's {sorted(rope)}: the heads use the target's SWA rotary"
        )
        return head

    @torch.inference_mode()
    def forward_layer(
        self,
        j: int,
        token_ids: Tensor,
        prev_hidden: Tensor,
        positions: Tensor,
        batch: AttentionBatch,
        kv: PagedKV,
        embed: Embed,
        rope: RopeTables,
    ) -> Tensor:
        """Head ``j`` over a packed, paged batch -> h^{j+1} [T, hidden] (final-normed).

        token_ids int64 [T]: row i's token t_{i+j+1}; prev_hidden [T, hidden]: h^j of each row;
        positions int64 [T] (row i's position, 1-D); ``batch``: these T rows (cu_seqlens over the
        sequences, each KV group's slots where a row's KV goes and page table); ``kv``: a cache with
        the heads' layers appended (``KVLayout.from_model_config(..., mtp_layers=...)``); ``embed``
        and ``rope``: the target's ``embed`` and its ``rope_tables(positions, dtype)``. Writes the
        rows' K/V into cache layer ``kv_layer(j)`` at their slots, then attends, as a target SWA
        layer does, through the backends of ``after_load`` (the torch reference before it)."""
        head = self._head(j, rope)
        t = token_ids.shape[0]
        assert positions.dim() == 1, "MTP heads take 1-D positions [T]"
        assert prev_hidden.shape == (t, self.config.hidden_size) and positions.shape[0] == t, (
            "token_ids, prev_hidden and positions disagree"
        )
        assert batch.num_tokens == t, "batch describes a different number of rows"
        runner, block = self._blocks[j]
        # The block in one call of its runner, as the target's layers run: x becomes the MLP's
        # output and residual x + attn, whose sum final_layernorm normalizes.
        threads = torch.get_num_threads()
        # A few rows right after a layer call (the target's or the previous head's), on one
        # thread: the CPU layer kernel's workers still spin on the other cores, and a torch op
        # split over threads would wait for one (~0.1 ms here, the product itself ~10 us). A
        # prefill chunk's rows are worth the threads.
        with torch_threads(1 if t <= SMALL_MIX_ROWS else threads):
            x = runner.hidden_input(head.mix(embed(token_ids), prev_hidden), owned=True)  # [T, hidden]
        cos, sin = rope[head.self_attn.rotary.key]
        layer_kv = kv.layer(head.self_attn.layer_idx)
        x, residual = runner.forward(block, runner.begin(batch), layer_kv, cos, sin, x, None)
        return head.final_layernorm.add_forward(x, residual)[0]

    def forward_layer_dense(
        self,
        j: int,
        token_ids: Tensor,
        prev_hidden: Tensor,
        embed: Embed,
        rope_tables: RopeTablesFn,
    ) -> Tensor:
        """Head ``j`` over one whole sequence at positions 0 .. S-1, no cache -> h^{j+1} [S, hidden].

        token_ids int64 [S] (row i: t_{i+j+1}), prev_hidden [S, hidden] (h^j); ``embed`` and
        ``rope_tables``: the target's ``embed`` and ``rope_tables`` methods. Causal, sliding window
        and sinks through ``MiMoAttention.forward_dense`` (the math of the target's dense SWA
        layers). Records autograd when it is on (for training the heads): inference-mode inputs
        are copied first, and the norms take a differentiable op."""
        s = token_ids.shape[0]
        assert token_ids.dim() == 1 and prev_hidden.shape == (s, self.config.hidden_size), (
            "token_ids [S] and prev_hidden [S, hidden] disagree"
        )
        positions = torch.arange(s, device=token_ids.device)
        x = _plain(embed(token_ids))  # [S, hidden]
        rope = {
            key: (_plain(cos), _plain(sin)) for key, (cos, sin) in rope_tables(positions, x.dtype).items()
        }
        head = self._head(j, rope)
        x = head.mix(x, _plain(prev_hidden))
        attn = head.self_attn.forward_dense(_norm(head.input_layernorm, x), positions, rope)
        return head.finish(x, attn)


def num_layers_in(names: Iterable[str]) -> int:
    """How many heads the state-dict ``names`` (without ``MTP_PREFIX``) describe: every name is under
    ``layers.{i}.`` and the indices are 0 .. n-1 with none missing."""
    seen: set[int] = set()
    for name in names:
        m = _LAYER.match(name)
        if m is None:
            raise MTPFormatError(f"unexpected tensor {MTP_PREFIX}{name}: MTP tensors are under layers.<i>.")
        seen.add(int(m.group(1)))
    missing = sorted(set(range(max(seen, default=-1) + 1)) - seen)
    if missing:
        raise MTPFormatError(f"MTP head {missing[0]} has no tensors (heads up to {max(seen)} have)")
    return len(seen)


def split_mtp_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Remove the heads' tensors from ``state`` (in place) and return them without ``MTP_PREFIX``."""
    names = [n for n in state if n.startswith(MTP_PREFIX)]
    return {n[len(MTP_PREFIX) :]: state.pop(n) for n in names}
