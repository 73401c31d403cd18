"""KV cache groups: one frozen spec per layer group, derived from the model config."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from llm_core.caches.kv_groups import (
    FULL_ATTENTION,
    SLIDING_WINDOW,
    KVGroupSpec,
    kv_groups_from_config,
)
from llm_core.caches.kv_pool import KVLayout
from llm_core.models.config import DecoderConfig
from llm_core.models.qwen2_5_vl import parse_config as parse_qwen_config
from tests.fixtures import mimo_v2


def _qwen_config() -> DecoderConfig:
    return parse_qwen_config(
        {
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
        }
    )


def test_full_attention_model_has_one_group() -> None:
    cfg = _qwen_config()
    groups = kv_groups_from_config(cfg, dtype_bytes=2)
    assert len(groups) == 1
    (g,) = groups
    assert g.group_id == 0 and g.layers == (0, 1, 2) and g.num_mtp_layers == 0
    assert g.spec.kind == FULL_ATTENTION and g.spec.sliding_window is None and g.spec.window_tokens is None
    assert g.bytes_per_token == 3 * 2 * (8 + 8) * 2
    assert KVLayout.from_model_config(cfg).groups == kv_groups_from_config(cfg, dtype_bytes=2)


def test_mimo_has_a_full_and_a_sliding_window_group() -> None:
    cfg = DecoderConfig.from_hf_dict(mimo_v2.text_config())
    groups = kv_groups_from_config(cfg, dtype_bytes=2, mtp_layers=1)
    assert [g.spec.kind for g in groups] == [FULL_ATTENTION, SLIDING_WINDOW]
    full, swa = groups
    assert full.layers == cfg.full_layer_ids
    assert swa.layers == (*cfg.window_layer_ids, cfg.num_hidden_layers) and swa.num_mtp_layers == 1
    assert swa.spec.sliding_window == cfg.sliding_window and swa.spec.window_tokens == cfg.sliding_window - 1
    assert swa.spec.sinks and not full.spec.sinks  # the release's sink bias is on SWA layers only
    assert (full.spec.kv_heads, swa.spec.kv_heads) == (cfg.num_key_value_heads, cfg.swa_num_key_value_heads)
    # the layout is those groups
    layout = KVLayout.from_model_config(cfg, torch.bfloat16, mtp_layers=1)
    assert layout.groups == groups
    assert [g.bytes_per_token for g in groups] == [
        layout.bytes_per_token(sliding=False),
        layout.bytes_per_token(sliding=True),
    ]


@dataclass(frozen=True)
class _TwoWindows:
    """A config whose sliding-window layers use two window sizes (read per layer)."""

    num_hidden_layers: int = 6
    head_dim: int = 8
    v_head_dim: int = 8

    def window(self, i: int) -> int | None:
        return None if i == 0 else (512 if i % 2 else 64)

    def num_kv_heads(self, i: int) -> int:
        return 2

    def has_sinks(self, i: int) -> bool:
        return False


def test_two_window_sizes_give_two_sliding_window_groups() -> None:
    groups = kv_groups_from_config(_TwoWindows(), dtype_bytes=2)
    assert [(g.spec.kind, g.spec.sliding_window, g.layers) for g in groups] == [
        (FULL_ATTENTION, None, (0,)),
        (SLIDING_WINDOW, 64, (2, 4)),
        (SLIDING_WINDOW, 512, (1, 3, 5)),
    ]
    assert [g.group_id for g in groups] == [0, 1, 2]


def test_spec_is_frozen_and_checked() -> None:
    spec = KVGroupSpec(FULL_ATTENTION, 2, 8, 8, 2)
    with pytest.raises(AttributeError):
        spec.kv_heads = 3  # type: ignore[misc]
    with pytest.raises(AssertionError):
        KVGroupSpec(SLIDING_WINDOW, 2, 8, 8, 2)  # a window needs its size
    assert spec.describe()["kind"] == FULL_ATTENTION
