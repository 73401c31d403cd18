"""The rank-interleaved fused q/k/v projection (llm_core/models/fused_qkv.py): de-interleaving by
head against a layout built here, per-rank FP8 scale tiling, and errors that name the tensor."""

from __future__ import annotations

import pytest
import torch

from llm_core.models.config import ConfigError
from llm_core.models.family import TensorFormatError
from llm_core.models.fp8 import BlockFP8
from llm_core.models.fused_qkv import FusedQKVLayout, split_fused_qkv

HEADS, KV, D, DV, RANKS, COLS = 8, 4, 6, 4, 2, 5


def _interleave(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ranks: int) -> torch.Tensor:
    """The checkpoint's layout written head by head: for each rank, its query heads, then its key
    heads, then its value heads."""
    heads, kv = q.shape[0] // D, k.shape[0] // D
    rows = []
    for r in range(ranks):
        rows += [q[h * D : (h + 1) * D] for h in range(r * heads // ranks, (r + 1) * heads // ranks)]
        rows += [k[h * D : (h + 1) * D] for h in range(r * kv // ranks, (r + 1) * kv // ranks)]
        rows += [v[h * DV : (h + 1) * DV] for h in range(r * kv // ranks, (r + 1) * kv // ranks)]
    return torch.cat(rows)


def _qkv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(HEADS * D, COLS, generator=gen),
        torch.randn(KV * D, COLS, generator=gen),
        torch.randn(KV * DV, COLS, generator=gen),
    )


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_split_recovers_q_k_v(ranks: int) -> None:
    q, k, v = _qkv()
    layout = FusedQKVLayout(HEADS, KV, D, DV, ranks)
    assert layout.rows_per_rank == (HEADS * D + KV * D + KV * DV) // ranks
    got = split_fused_qkv("l.qkv_proj.weight", _interleave(q, k, v, ranks), layout)
    assert torch.equal(got.q, q) and torch.equal(got.k, k) and torch.equal(got.v, v)


def test_fp8_scales_are_tiled_per_rank() -> None:
    """Rank slices of 44 rows in blocks of 8: 6 scale rows per rank (12 in all; the whole tensor would
    tile to 11), and rank 1's first row uses scale row 6, not row 44 // 8 = 5."""
    q, k, v = _qkv(1)
    fmt = BlockFP8(8, 8)
    layout = FusedQKVLayout(HEADS, KV, D, DV, RANKS)
    per = layout.rows_per_rank
    assert per == 44
    fused = _interleave(q, k, v, RANKS).to(torch.float8_e4m3fn)
    scale = torch.arange(1.0, 13.0)[:, None]  # [12, 1]: scale row i multiplies by i + 1
    got = split_fused_qkv(
        "l.qkv_proj.weight",
        fused,
        layout,
        scale,
        8,
        lambda w, s, label: fmt.module_weight(label, w, s, torch.float32),
    )
    # the reference: row i of rank r is multiplied by scale row r * 6 + (i % 44) // 8
    row_scale = torch.tensor([float(1 + (i // per) * 6 + (i % per) // 8) for i in range(2 * per)])
    want = _interleave(*(t.to(torch.float8_e4m3fn).float() for t in (q, k, v)), RANKS) * row_scale[:, None]
    assert torch.equal(torch.cat([got.q, got.k, got.v]), _deinterleaved_rows(want))


def _deinterleaved_rows(fused: torch.Tensor) -> torch.Tensor:
    """[Q | K | V] from the interleaved rows, by gathering each head's rows from its rank."""
    per, q_r, k_r = 44, HEADS // RANKS * D, KV // RANKS * D
    q = [fused[r * per : r * per + q_r] for r in range(RANKS)]
    k = [fused[r * per + q_r : r * per + q_r + k_r] for r in range(RANKS)]
    v = [fused[r * per + q_r + k_r : (r + 1) * per] for r in range(RANKS)]
    return torch.cat(q + k + v)


def test_errors_name_the_tensor() -> None:
    layout = FusedQKVLayout(HEADS, KV, D, DV, RANKS)
    fused = torch.zeros(layout.rows, COLS)
    with pytest.raises(
        TensorFormatError, match=r"'x\.qkv_proj\.weight' has 87 rows, which do not divide into 2"
    ):
        split_fused_qkv("x.qkv_proj.weight", fused[:-1], layout)
    with pytest.raises(TensorFormatError, match=r"'x\.qkv_proj\.weight' has 86 rows; the config implies 88"):
        split_fused_qkv("x.qkv_proj.weight", fused[:-2], layout)
    with pytest.raises(
        TensorFormatError, match=r"'x\.qkv_proj\.weight_scale_inv' has shape \(11, 1\).*12 scale rows"
    ):
        split_fused_qkv(
            "x.qkv_proj.weight",
            fused,
            layout,
            torch.ones(11, 1),
            8,
            scale_label="x.qkv_proj.weight_scale_inv",
        )


def test_heads_must_split_over_the_ranks() -> None:
    with pytest.raises(ConfigError, match="key/value heads=4 do not split over the fused qkv_proj's 3"):
        FusedQKVLayout(6, 4, D, DV, 3)
    with pytest.raises(ConfigError, match="num_attention_heads=6"):
        FusedQKVLayout(6, 4, D, DV, 4)
