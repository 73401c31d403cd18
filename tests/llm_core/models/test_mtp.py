"""The multi-token-prediction heads' module (llm_core/models/mtp.py): its parameter names are the
checkpoint's (less ``model.mtp.``, with q/k/v split), one sliding-window layer per head, and the
head count read from the tensor names."""

from __future__ import annotations

import pytest
import torch

from llm_core.models.checkpoint import default_llm_config
from llm_core.models.mtp import MTPFormatError, MTPHeads, num_layers_in, split_mtp_state


def test_parameter_names_and_shapes() -> None:
    cfg = default_llm_config()
    h, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.swa_num_key_value_heads
    with torch.device("meta"):
        heads_module = MTPHeads(cfg, 2)
    shapes = {name: tuple(t.shape) for name, t in heads_module.state_dict().items()}
    want = {
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (heads * cfg.head_dim, h),
        "self_attn.k_proj.weight": (kv * cfg.head_dim, h),
        "self_attn.v_proj.weight": (kv * cfg.v_head_dim, h),
        "self_attn.o_proj.weight": (h, heads * cfg.v_head_dim),
        "self_attn.sinks": (heads,),
        "pre_mlp_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (cfg.intermediate_size, h),
        "mlp.up_proj.weight": (cfg.intermediate_size, h),
        "mlp.down_proj.weight": (h, cfg.intermediate_size),
        "final_layernorm.weight": (h,),
    }
    assert shapes == {f"layers.{i}.{k}": v for i in range(2) for k, v in want.items()}
    attn = heads_module.heads()[1].self_attn
    assert attn.window is not None and attn.window == cfg.sliding_window and attn.num_kv_heads == kv


def test_head_count_from_names() -> None:
    assert (
        num_layers_in(["layers.0.enorm.weight", "layers.2.mlp.up_proj.weight", "layers.1.hnorm.weight"]) == 3
    )
    with pytest.raises(MTPFormatError, match="MTP head 1 has no tensors"):
        num_layers_in(["layers.0.enorm.weight", "layers.2.enorm.weight"])
    with pytest.raises(MTPFormatError, match=r"unexpected tensor mtp\.shared_head\.weight"):
        num_layers_in(["layers.0.enorm.weight", "shared_head.weight"])


def test_split_mtp_state() -> None:
    t = torch.zeros(1)
    state = {"model.norm.weight": t, "mtp.layers.0.enorm.weight": t}
    assert split_mtp_state(state) == {"layers.0.enorm.weight": t}
    assert list(state) == ["model.norm.weight"]
