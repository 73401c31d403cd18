"""Multi-token-prediction heads (MiMo-V2.5's ``model.mtp.layers.{i}``, DeepSeek-V3's NextN style).

Loaded and shape-checked with the language model so that speculative decoding can use them; not
run yet. Each head predicts one token further than the one before it, from the previous hidden
state and the embedding of the token just predicted (embedding and lm_head are the model's)::

    h   = eh_proj(cat(enorm(embed(token)), hnorm(prev_hidden)))      [T, 2 * hidden] -> [T, hidden]
    h  += self_attn(input_layernorm(h))       a sliding-window layer (swa_* heads, sinks)
    h  += mlp(pre_mlp_layernorm(h))           dense SwiGLU, intermediate_size
    out = final_layernorm(h)                  -> the model's lm_head

State-dict names (the checkpoint's, less ``model.mtp.``; a fused ``qkv_proj`` is split by the
family's converter): ``layers.{i}.{enorm,hnorm,eh_proj,input_layernorm,pre_mlp_layernorm,
final_layernorm}.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``layers.{i}.self_attn.sinks``,
``layers.{i}.mlp.{gate,up,down}_proj.weight``. The checkpoint does not say how many heads it has
(MiMo ships 3): the loader counts them in the tensor names (``num_layers_in``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import cast

from torch import Tensor, nn

from llm_core.models.config import SWA, DecoderConfig
from llm_core.models.decoder import MiMoAttention, RMSNorm
from llm_core.models.moe import DenseMLP

# Prefix of the heads' tensors in the loader's state dict (what a family's tensor_name maps them to).
MTP_PREFIX = "mtp."
_LAYER = re.compile(r"^layers\.(\d+)\.")


class MTPFormatError(ValueError):
    """MTP tensor names that do not describe heads 0 .. n-1; names the tensor."""


def head_config(config: DecoderConfig) -> DecoderConfig:
    """The config of one head's decoder layer: a single sliding-window layer with a dense MLP."""
    return dataclasses.replace(config, num_hidden_layers=1, layer_types=(SWA,), mlp_layer_types=("dense",))


class MTPLayer(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = MiMoAttention(head_config(config), 0)
        self.pre_mlp_layernorm = RMSNorm(hidden, eps)
        self.mlp = DenseMLP(hidden, config.intermediate_size)
        self.final_layernorm = RMSNorm(hidden, eps)


class MTPHeads(nn.Module):
    """``num_layers`` heads (see the module docstring); parameters only, no forward yet."""

    def __init__(self, config: DecoderConfig, num_layers: int) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(MTPLayer(config) for _ in range(num_layers))

    def heads(self) -> list[MTPLayer]:
        return cast(list[MTPLayer], list(self.layers))


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
