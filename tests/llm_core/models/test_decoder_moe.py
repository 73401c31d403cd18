"""MoE routing and grouped experts vs transformers' router and a per-token reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from llm_core.backends import moe_torch as moe_module
from llm_core.backends.moe_torch import TorchMoE
from llm_core.kernels import cpu_moe
from llm_core.models.config import DecoderConfig
from llm_core.models.moe import GroupedExperts, Routing, SparseMoE, TopKRouter


def moe_config(**kw: Any) -> DecoderConfig:
    base: dict[str, Any] = {
        "vocab_size": 16,
        "hidden_size": 24,
        "intermediate_size": 32,
        "moe_intermediate_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "swa_num_key_value_heads": 2,
        "head_dim": 8,
        "v_head_dim": 4,
        "sliding_window": 4,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
    }
    base.update(kw)
    return DecoderConfig(**base)


def per_token_reference(experts: GroupedExperts, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(routing.experts.shape[1]):
            e = int(routing.experts[t, k])
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            out[t] += routing.weights[t, k] * (experts.down_proj[e] @ (F.silu(gate) * up))
    return out


def test_router_matches_transformers() -> None:
    from transformers import MiMoV2FlashConfig
    from transformers.models.mimo_v2_flash.modeling_mimo_v2_flash import MiMoV2FlashTopkRouter

    cfg = moe_config()
    hf_cfg = MiMoV2FlashConfig(
        hidden_size=cfg.hidden_size,
        n_routed_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.num_experts_per_tok,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor,
        norm_topk_prob=True,
    )
    theirs = MiMoV2FlashTopkRouter(hf_cfg)
    ours = TopKRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(theirs.weight.shape, generator=g))
        theirs.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
        ours.weight.copy_(theirs.weight)
        ours.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(64, cfg.hidden_size, generator=g)
    _, ref_w, ref_idx = theirs(x)
    routing = ours(x)
    # Same set of experts per token (order is unspecified), same weight per expert.
    ours_sorted, o = routing.experts.sort(dim=-1)
    ref_sorted, r = ref_idx.sort(dim=-1)
    assert torch.equal(ours_sorted, ref_sorted)
    torch.testing.assert_close(routing.weights.gather(1, o), ref_w.gather(1, r))
    # Group limit: all chosen experts lie in at most topk_group groups.
    groups = routing.experts // (cfg.n_routed_experts // cfg.n_group)
    assert all(len(set(row)) <= cfg.topk_group for row in groups.tolist())


def _random_moe(
    padded_max_tokens: int, monkeypatch: pytest.MonkeyPatch, seed: int
) -> tuple[DecoderConfig, SparseMoE, torch.Generator]:
    """A SparseMoE with random weights on its torch paths (the C kernel, tested in test_cpu_moe, is
    switched off), the padded one for batches up to ``padded_max_tokens`` tokens (0: always the
    per-expert loop); also returns the generator, for the inputs."""
    monkeypatch.setattr(cpu_moe, "_kernel", None)
    monkeypatch.setattr(moe_module, "PADDED_MAX_TOKENS", padded_max_tokens)
    monkeypatch.setattr(moe_module, "PADDED_WASTE", 1000)
    cfg = moe_config()
    moe = SparseMoE(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return cfg, moe, g


@pytest.mark.parametrize("padded_max_tokens", [0, 1000], ids=["looped", "padded"])
def test_grouped_experts_match_per_token_loop(
    padded_max_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both expert paths: one matmul pair per expert, and all experts padded into two bmm calls."""
    cfg, moe, g = _random_moe(padded_max_tokens, monkeypatch, seed=1)
    x = torch.randn(37, cfg.hidden_size, generator=g)
    routing = moe.gate(x)
    out = moe(x)
    torch.testing.assert_close(out, per_token_reference(moe.experts, x, routing), rtol=1e-5, atol=1e-5)
    # Batched or alone: each token's output does not depend on the other tokens in the batch.
    torch.testing.assert_close(moe(x[5:6]), out[5:6], rtol=1e-5, atol=1e-6)


def test_router_without_groups_or_normalisation() -> None:
    cfg = moe_config(n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    router = TopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(2)))
    x = torch.randn(10, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    routing = router(x)
    scores = torch.sigmoid(x @ router.weight.T)
    top = scores.topk(cfg.num_experts_per_tok, dim=-1)
    torch.testing.assert_close(routing.weights.sort(-1).values, top.values.sort(-1).values)


@pytest.mark.parametrize("padded_max_tokens", [0, 1000], ids=["looped", "padded"])
def test_expert_relayout_keeps_values_and_outputs(
    padded_max_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pack hook (``after_load``) changes only the strides of the expert weights: same shapes and values, the
    [E, in, out] view becomes contiguous, and both expert paths give bit-identical outputs."""
    cfg, moe, g = _random_moe(padded_max_tokens, monkeypatch, seed=4)
    x = torch.randn(21, cfg.hidden_size, generator=g)
    before = moe(x)
    weights = [moe.experts.gate_up_proj.detach().clone(), moe.experts.down_proj.detach().clone()]
    moe.experts.after_load(TorchMoE())
    for p, w in zip((moe.experts.gate_up_proj, moe.experts.down_proj), weights, strict=True):
        assert p.shape == w.shape and torch.equal(p, w)
        assert p.transpose(1, 2).is_contiguous()
    assert torch.equal(moe(x), before)
    moe.experts.after_load(TorchMoE())  # idempotent
    assert moe.experts.gate_up_proj.transpose(1, 2).is_contiguous()
    assert torch.equal(moe(x), before)
