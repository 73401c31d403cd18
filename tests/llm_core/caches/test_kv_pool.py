"""Page pools, pool sizing from a byte budget, and the dual-pool KV tensors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from llm_core.caches.kv_pool import (
    DualKVCache,
    KVCacheConfig,
    KVLayout,
    PagePool,
    balanced_swa_fraction,
    plan_pools,
    swa_pages_per_sequence,
)
from tests.llm_core.conftest import TINY_MIMO_CONFIG


def small_layout() -> KVLayout:
    # 7 layers, 0 and 5 full (the agreed rule), as in the tiny test checkpoint.
    return KVLayout(
        layer_is_swa=tuple(not (i == 0 or (i + 1) % 6 == 0) for i in range(7)),
        full_kv_heads=2,
        swa_kv_heads=4,
        head_dim=32,
        v_head_dim=16,
        sliding_window=8,
        dtype_bytes=4,
    )


def test_page_pool_alloc_free_conserves_pages() -> None:
    pool = PagePool(10, 4)
    a = pool.alloc(3)
    b = pool.alloc(7)
    assert a is not None and b is not None
    assert len(set(a) | set(b)) == 10 and pool.num_free == 0
    assert pool.alloc(1) is None  # nothing taken on failure
    pool.check_integrity()
    pool.free(a)
    assert pool.num_free == 3 and pool.num_used == 7
    pool.free([-1])  # NOT_RESIDENT entries are skipped
    pool.check_integrity()
    with pytest.raises(AssertionError, match="double free"):
        pool.free([a[0]])


def test_swa_pages_per_sequence_bounds_any_window_placement() -> None:
    for window in (1, 2, 8, 9, 17, 128, 129):
        for page in (1, 4, 16):
            worst = 0
            for p in range(0, 3 * window + 3 * page):  # query position; keys [p-W+1, p]
                lo = max(0, p - window + 1)
                worst = max(worst, p // page - lo // page + 1)
            assert worst <= swa_pages_per_sequence(window, page)
            if window >= page:
                assert worst == swa_pages_per_sequence(window, page)


def test_layout_from_model_configs_matches_modeling_shapes() -> None:
    from transformers import MiMoV2FlashConfig

    from llm_core.models.config import DecoderConfig

    hf = MiMoV2FlashConfig(**TINY_MIMO_CONFIG)
    assert KVLayout.from_model_config(hf, dtype=torch.float32) == small_layout()
    ours = DecoderConfig.from_hf_dict(hf.to_dict())
    layout = KVLayout.from_model_config(ours, dtype=torch.float32)
    assert layout == small_layout()
    assert layout.num_full_layers == 2 and layout.num_swa_layers == 5
    assert layout.full_bytes_per_token == 2 * 2 * (32 + 16) * 4
    assert layout.swa_bytes_per_token == 5 * 4 * (32 + 16) * 4


def test_plan_pools_stays_within_budget_and_balances() -> None:
    layout = small_layout()
    budget = 8 << 20
    for ctx in (64, 1024, 8192):
        cfg = KVCacheConfig(memory_budget_bytes=budget, page_size=16, balance_context_len=ctx)
        plan = plan_pools(layout, cfg)
        assert plan.total_bytes <= budget
        # Both pools run out at about the same number of sequences of length ctx.
        seqs_full = plan.num_full_pages / math.ceil(ctx / 16)
        seqs_swa = plan.num_swa_pages / min(swa_pages_per_sequence(8, 16), math.ceil(ctx / 16))
        assert abs(seqs_full - seqs_swa) <= max(1.0, 0.02 * seqs_full)  # page rounding
    frac = balanced_swa_fraction(layout, 8192, 16)
    assert 0 < frac < 0.1  # a window of one page against 512 pages of full KV
    # Headroom for the prefill in flight comes on top of the balanced windows.
    base = plan_pools(
        layout, KVCacheConfig(memory_budget_bytes=budget, page_size=16, balance_context_len=1024)
    )
    roomy = plan_pools(
        layout,
        KVCacheConfig(
            memory_budget_bytes=budget, page_size=16, balance_context_len=1024, swa_headroom_tokens=4096
        ),
    )
    assert roomy.num_swa_pages >= base.num_swa_pages + 512 // 16 - 1 and roomy.total_bytes <= budget
    with pytest.raises(ValueError, match="swa_fraction"):
        KVCacheConfig(memory_budget_bytes=budget, swa_fraction=1.5)


def test_dual_kv_cache_layers_use_their_pool_shapes() -> None:
    layout = small_layout()
    kv = DualKVCache(layout, num_full_pages=6, num_swa_pages=3, page_size=4)
    assert kv.num_layers == 7
    for i in range(7):
        layer = kv.layer(i)
        assert layer.is_swa == layout.layer_is_swa[i]
        n, h = (3, 4) if layer.is_swa else (6, 2)
        assert layer.k.shape == (n, 4, h, 32) and layer.v.shape == (n, 4, h, 16)
    assert kv.full_pages.num_pages == 6 and kv.swa_pages.num_pages == 3
    # A flat slot addresses the same element as [page, offset].
    kv.layer(1).k[2, 3] = 7.0
    assert torch.equal(kv.layer(1).k.view(-1, 4, 32)[2 * 4 + 3], kv.layer(1).k[2, 3])
    sized = DualKVCache.from_budget(layout, KVCacheConfig(memory_budget_bytes=1 << 20, page_size=4))
    plan = plan_pools(layout, KVCacheConfig(memory_budget_bytes=1 << 20, page_size=4))
    assert (sized.full_pages.num_pages, sized.swa_pages.num_pages) == plan[:2]
    kv.check_integrity()


def test_kv_capacity_bench_quick_dual_pool_beats_uniform(tmp_path: Path) -> None:
    import json

    from bench import kv_capacity

    out = tmp_path / "kv.json"
    summary = kv_capacity.main(["--quick", "--json", str(out)])
    assert summary["capacity_ratio_32k"] >= 6.0  # type: ignore[operator]
    doc = json.loads(out.read_text())
    for row in doc["results"]:
        # The allocator agrees with the closed form up to whole-sequence rounding.
        assert (
            row["dual_seqs"] >= 1
            and abs(row["ratio"] - row["closed_form_ratio"]) / row["closed_form_ratio"] < 0.15
        )
