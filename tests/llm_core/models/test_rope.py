"""Partial rotary against transformers' own MiMo-V2-Flash rotary code.

The reference is ``MiMoV2FlashRotaryEmbedding`` (cos/sin per layer type, from the config's
``rope_parameters``) and ``apply_rotary_pos_emb`` (rotate_half on the leading dims, the rest passed
through), called from transformers' modeling module, not re-typed here. Ours is built from the same
config by our own config reader and attention module, so the chain config -> (rope_dim, theta) ->
tables -> rotation is compared end to end, bit for bit (the same fp32 angles and the same products
and sums in the rotation).
"""

from __future__ import annotations

import pytest
import torch
from transformers import MiMoV2FlashConfig
from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import (
    MiMoV2FlashRotaryEmbedding,
    apply_rotary_pos_emb,
)

from llm_core.models.config import DecoderConfig
from llm_core.models.decoder import DecoderForCausalLM, MiMoAttention
from llm_core.models.rope import apply_partial_rotary, apply_partial_rotary_

LAYER_TYPES = ["full_attention", "sliding_attention"]
HEADS, KV_HEADS, TOKENS = 8, 2, 37

# (head_dim, full-attention factor, SWA factor): the tiny checkpoint's shape (rope_dim 10 of 32), an
# odd rope_dim (int(64 * 0.334) = 21, the rotated width rounds up to 22) and a full rotation.
ROPE_CASES = [(32, 0.334, 0.334), (64, 0.334, 1.0), (64, 1.0, 0.5)]


def hf_config(head_dim: int, full_factor: float, swa_factor: float) -> MiMoV2FlashConfig:
    return MiMoV2FlashConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=head_dim,
        v_head_dim=16,
        sliding_window=8,
        layer_types=LAYER_TYPES,
        mlp_layer_types=["dense"] * len(LAYER_TYPES),
        rope_parameters={
            "full_attention": {
                "rope_type": "default",
                "rope_theta": 5e6,
                "partial_rotary_factor": full_factor,
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": swa_factor,
            },
        },
    )


def hf_cos_sin(
    emb: MiMoV2FlashRotaryEmbedding, positions: torch.Tensor, layer_type: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' (cos, sin) [T, width] for ``layer_type``; x only sets device and dtype."""
    cos, sin = emb(torch.zeros(1, dtype=dtype), positions[None], layer_type)
    return cos[0], sin[0]


def hf_rotate(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb on our [T, H, D] layout (it takes [B, H, T, D])."""
    q_ref, k_ref = apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
    )
    return q_ref[0].transpose(0, 1), k_ref[0].transpose(0, 1)


def positions_for(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 100_000, (TOKENS,), generator=g)


@pytest.mark.parametrize(("head_dim", "full_factor", "swa_factor"), ROPE_CASES)
def test_tables_equal_transformers_rotary_embedding(
    head_dim: int, full_factor: float, swa_factor: float
) -> None:
    hf = hf_config(head_dim, full_factor, swa_factor)
    ours = DecoderConfig.from_hf_dict(hf.to_dict())
    emb = MiMoV2FlashRotaryEmbedding(hf)
    positions = positions_for(head_dim)
    for i, layer_type in enumerate(LAYER_TYPES):
        rot = MiMoAttention(ours, i).rotary
        ref_cos, ref_sin = hf_cos_sin(emb, positions, layer_type, torch.float32)
        assert rot.width == ref_cos.shape[-1] == ours.rotary_dim(i) <= head_dim
        cos, sin = rot.cos_sin(positions, torch.float32)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin), layer_type


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("head_dim", "full_factor", "swa_factor"), ROPE_CASES)
def test_rotation_is_bit_identical_to_transformers(
    head_dim: int, full_factor: float, swa_factor: float, dtype: torch.dtype
) -> None:
    hf = hf_config(head_dim, full_factor, swa_factor)
    ours = DecoderConfig.from_hf_dict(hf.to_dict())
    emb = MiMoV2FlashRotaryEmbedding(hf)
    positions = positions_for(head_dim + 1)
    g = torch.Generator().manual_seed(head_dim)
    for i, layer_type in enumerate(LAYER_TYPES):
        rot = MiMoAttention(ours, i).rotary
        cos, sin = hf_cos_sin(emb, positions, layer_type, dtype)
        # q and k as strided views of one fused projection output, with columns after them.
        buf = torch.randn(TOKENS, (HEADS + KV_HEADS) * head_dim + 50, generator=g).to(dtype)
        q = buf[:, : HEADS * head_dim].view(TOKENS, HEADS, head_dim)
        k = buf[:, HEADS * head_dim : (HEADS + KV_HEADS) * head_dim].view(TOKENS, KV_HEADS, head_dim)
        q_ref, k_ref = hf_rotate(q, k, cos, sin)
        assert not torch.equal(q_ref, q)  # the reference does rotate

        q_out, k_out = rot(q, k, positions)  # the module: its own tables, new tensors
        assert q_out.dtype == dtype and torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref), layer_type
        assert torch.equal(apply_partial_rotary(q, cos, sin), q_ref)

        before = buf.clone()
        out = apply_partial_rotary_(q, cos, sin)  # in place, on the strided view
        assert out.data_ptr() == q.data_ptr() and torch.equal(out, q_ref)
        width = cos.shape[-1]
        assert torch.equal(
            q[..., width:], before[:, : HEADS * head_dim].view(TOKENS, HEADS, head_dim)[..., width:]
        )
        assert torch.equal(
            buf[:, HEADS * head_dim :], before[:, HEADS * head_dim :]
        )  # k and the rest untouched


def test_model_rope_tables_equal_transformers() -> None:
    """The per-step tables the paged forward and the C layer kernel read (cached per position, grown
    by doubling) against transformers', for positions that cross a growth of the cache."""
    hf = hf_config(64, 0.334, 1.0)
    ours = DecoderConfig.from_hf_dict(hf.to_dict())
    model = DecoderForCausalLM(ours)
    emb = MiMoV2FlashRotaryEmbedding(hf)
    steps: list[torch.Tensor] = [torch.arange(5), torch.tensor([3, 700, 2, 5000]), positions_for(7)]
    for positions in steps:
        tables = model.rope_tables(positions, torch.float32)
        assert len(tables) == len(LAYER_TYPES)
        for i, layer_type in enumerate(LAYER_TYPES):
            cos, sin = tables[(ours.rope_dim(i), ours.rope_theta_of(i))]
            ref_cos, ref_sin = hf_cos_sin(emb, positions, layer_type, torch.float32)
            assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin), (layer_type, positions)
