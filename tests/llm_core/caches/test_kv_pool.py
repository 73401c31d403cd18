"""Page pools, pool sizing from a byte budget, and the KV tensors of each group's pool."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from llm_core.caches.kv_groups import layer_spec, window_pages
from llm_core.caches.kv_manager import KVManager, group_managers
from llm_core.caches.kv_pool import (
    KVCacheConfig,
    KVLayout,
    PagedKVCache,
    balanced_window_share,
    plan_group_pools,
)
from llm_core.caches.page_pool import PagePool
from llm_core.caches.seq_kv import NOT_RESIDENT
from llm_core.request import Sequence
from llm_core.serving.page_tables import build_page_tables
from tests.llm_core.conftest import TINY_MIMO_CONFIG


def small_layout() -> KVLayout:
    # 7 layers, 0 and 5 full (the agreed rule), as in the tiny test checkpoint.
    return KVLayout.hybrid(
        [None if i == 0 or (i + 1) % 6 == 0 else 8 for i in range(7)],
        full_kv_heads=2,
        window_kv_heads=4,
        head_dim=32,
        v_head_dim=16,
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


def test_window_pages_bounds_any_window_placement() -> None:
    for window in (1, 2, 8, 9, 17, 128, 129):
        for page in (1, 4, 16):
            worst = 0
            for p in range(0, 3 * window + 3 * page):  # query position; keys [p-W+1, p]
                lo = max(0, p - window + 1)
                worst = max(worst, p // page - lo // page + 1)
            assert worst <= window_pages(window, page)
            if window >= page:
                assert worst == window_pages(window, page)


def test_layout_from_model_configs_matches_modeling_shapes() -> None:
    from transformers import MiMoV2FlashConfig

    from llm_core.models.config import DecoderConfig

    hf = MiMoV2FlashConfig(**TINY_MIMO_CONFIG)
    assert KVLayout.from_model_config(hf, dtype=torch.float32) == small_layout()
    ours = DecoderConfig.from_hf_dict(hf.to_dict())
    layout = KVLayout.from_model_config(ours, dtype=torch.float32)
    # ours knows the window layers' sinks (transformers' config class reads none): the same KV
    assert [
        dataclasses.replace(g, spec=dataclasses.replace(g.spec, sinks=False)) for g in layout.groups
    ] == list(small_layout().groups)
    assert [g.num_layers for g in layout.groups] == [2, 5]
    assert layout.bytes_per_token(sliding=False) == 2 * 2 * (32 + 16) * 4
    assert layout.bytes_per_token(sliding=True) == 5 * 4 * (32 + 16) * 4
    assert KVLayout.from_description(layout.describe()) == layout


def plan_bytes(layout: KVLayout, pages: tuple[int, ...], page: int) -> int:
    return sum(n * g.page_bytes(page) for n, g in zip(pages, layout.groups, strict=True))


def test_plan_group_pools_stays_within_budget_and_balances() -> None:
    layout = small_layout()
    budget = 8 << 20
    for ctx in (64, 1024, 8192):
        cfg = KVCacheConfig(memory_budget_bytes=budget, page_size=16, balance_context_len=ctx)
        n_full, n_window = plan = plan_group_pools(layout.groups, cfg)
        assert plan_bytes(layout, plan, 16) <= budget
        # Both pools run out at about the same number of sequences of length ctx.
        seqs_full = n_full / math.ceil(ctx / 16)
        seqs_window = n_window / min(window_pages(8, 16), math.ceil(ctx / 16))
        assert abs(seqs_full - seqs_window) <= max(1.0, 0.02 * seqs_full)  # page rounding
    frac = balanced_window_share(layout.groups, 8192, 16)
    assert 0 < frac < 0.1  # a window of one page against 512 pages of full KV
    # Headroom for the prefill in flight comes on top of the balanced windows.
    base = plan_group_pools(
        layout.groups, KVCacheConfig(memory_budget_bytes=budget, page_size=16, balance_context_len=1024)
    )
    roomy = plan_group_pools(
        layout.groups,
        KVCacheConfig(
            memory_budget_bytes=budget, page_size=16, balance_context_len=1024, window_headroom_tokens=4096
        ),
    )
    assert roomy[1] >= base[1] + 512 // 16 - 1 and plan_bytes(layout, roomy, 16) <= budget
    with pytest.raises(ValueError, match="window_fraction"):
        KVCacheConfig(memory_budget_bytes=budget, window_fraction=1.5)


def test_paged_kv_cache_layers_use_their_pool_shapes() -> None:
    layout = small_layout()
    kv = PagedKVCache(layout, page_size=4, group_pages=(6, 3))
    assert kv.num_layers == 7
    for i in range(7):
        layer = kv.layer(i)
        assert layer.window == (None if i in (0, 5) else 8)
        n, h = (6, 2) if layer.window is None else (3, 4)
        assert layer.k.shape == (n, 4, h, 32) and layer.v.shape == (n, 4, h, 16)
    assert [p.num_pages for p in kv.pools] == [6, 3]
    # A flat slot addresses the same element as [page, offset].
    kv.layer(1).k[2, 3] = 7.0
    assert torch.equal(kv.layer(1).k.view(-1, 4, 32)[2 * 4 + 3], kv.layer(1).k[2, 3])
    kv.check_integrity()


def test_a_budget_buys_one_shared_block_pool_or_with_a_fixed_split_a_pool_per_group() -> None:
    layout = small_layout()
    shared = PagedKVCache.from_budget(layout, KVCacheConfig(memory_budget_bytes=1 << 20, page_size=4))
    assert shared.blocks is not None and shared.block_layout is not None
    # a block is 1 slot (the full group's 2 layers of 2 heads fill one 4-head slot); a SWA page 5
    assert shared.block_layout.num_slots == 1 and shared.block_layout.blocks_per_page == (1, 5)
    assert shared.blocks.num_pages == (1 << 20) // shared.block_bytes
    assert [p.num_pages for p in shared.pools] == [shared.blocks.num_pages, shared.blocks.num_pages // 5]
    assert shared.describe_pool()["bytes"] == shared.blocks.num_pages * shared.block_bytes <= 1 << 20
    fixed = KVCacheConfig(memory_budget_bytes=1 << 20, page_size=4, window_fraction=0.4)
    split = PagedKVCache.from_budget(layout, fixed)
    assert split.blocks is None
    assert tuple(p.num_pages for p in split.pools) == plan_group_pools(layout.groups, fixed)


def test_kv_capacity_bench_quick_dual_pool_beats_uniform(tmp_path: Path) -> None:
    import json

    from bench import kv_capacity

    out = tmp_path / "kv.json"
    summary = kv_capacity.main(["--quick", "--json", str(out)])
    assert summary["capacity_ratio_32k"] >= 6.0  # type: ignore[operator]
    doc = json.loads(out.read_text())
    for row in doc["results"]:
        # the shared pool holds at least what a split tuned to the lengths holds
        assert row["shared_seqs"] >= row["dual_seqs"] >= 1
        if isinstance(row["context"], int):
            # The allocator agrees with the closed form up to whole-sequence rounding.
            assert abs(row["ratio"] - row["closed_form_ratio"]) / row["closed_form_ratio"] < 0.15


@pytest.mark.parametrize("fraction", [None, 0.3])
@pytest.mark.parametrize("full_only", [False, True])
def test_one_window_plan_follows_the_documented_split(fraction: float | None, full_only: bool) -> None:
    layout = small_layout()
    if full_only:
        layout = KVLayout.hybrid(
            [None] * 7, full_kv_heads=2, window_kv_heads=4, head_dim=32, v_head_dim=16, dtype_bytes=4
        )
    page, ctx = 16, 1000
    full_page, swa_page = (
        page * layout.bytes_per_token(sliding=False),
        page * layout.bytes_per_token(sliding=True),
    )
    for budget, headroom_tokens in ((1 << 20, 0), (3 << 20, 200), (12345678, 2048)):
        cfg = KVCacheConfig(
            budget, page, fraction, balance_context_len=ctx, window_headroom_tokens=headroom_tokens
        )
        # KVCacheConfig's rule, written out: the SWA pool gets the fraction, or the prefill headroom
        # plus the share at which both pools run out together for ctx tokens
        if swa_page == 0:
            swa_budget = 0
        elif fraction is not None:
            swa_budget = int(budget * fraction)
        else:
            headroom = min(math.ceil(headroom_tokens / page) * swa_page, budget // 2)
            full = math.ceil(ctx / page) * full_page
            swa = min(window_pages(8, page), math.ceil(ctx / page)) * swa_page
            swa_budget = headroom + int((budget - headroom) * (swa / (full + swa)))
        n_full = (budget - swa_budget) // full_page
        want = [swa_budget // swa_page if g.spec.is_sliding else n_full for g in layout.groups]
        assert plan_group_pools(layout.groups, cfg) == tuple(want)


def two_window_layout(windows: tuple[int, int]) -> KVLayout:
    """8 layers: 0 and 4 full (2 KV heads), 1-3 window windows[0] (4 heads), 5-7 windows[1] (1 head)."""
    kinds: list[int | None] = [
        None,
        windows[0],
        windows[0],
        windows[0],
        None,
        windows[1],
        windows[1],
        windows[1],
    ]
    heads = {None: 2, windows[0]: 4, windows[1]: 1}
    return KVLayout.of_layers([layer_spec(w, heads[w], 16, 8, 4) for w in kinds])


@pytest.mark.parametrize("window_fraction", [None, 0.5], ids=["shared_blocks", "pool_per_group"])
def test_two_window_sizes_get_a_group_each_and_free_by_their_own_window(
    window_fraction: float | None,
) -> None:
    page = 4
    layout = two_window_layout((6, 17))
    cfg = KVCacheConfig(1 << 20, page, window_fraction=window_fraction, balance_context_len=64)
    kv = PagedKVCache.from_budget(layout, cfg)
    assert [g.spec.sliding_window for g in kv.groups] == [None, 6, 17]
    assert [p.name for p in kv.pools] == ["full", "window6", "window17"]
    for i, g in enumerate(kv.layer_group):  # each layer's tensors have its group's KV shape
        spec = kv.groups[g].spec
        assert kv.layer(i).k.shape[1:] == (page, spec.kv_heads, 16)
        assert kv.layer(i).group == kv.page_map.layer_view[i]
    if kv.blocks is None:  # the budget went to the three pools, each a whole number of pages
        assert kv.page_map.layer_view == kv.layer_group
        used = sum(p.num_pages * g.page_bytes(page) for p, g in zip(kv.pools, kv.groups, strict=True))
        assert (1 << 20) - max(g.page_bytes(page) for g in kv.groups) * 3 < used <= 1 << 20
    else:  # to whole blocks of the one pool
        assert (1 << 20) - kv.block_bytes < kv.blocks.num_pages * kv.block_bytes <= 1 << 20

    manager = KVManager(group_managers(kv), enable_prefix_cache=False)
    seq = Sequence("a", list(range(40)))
    assert manager.allocate(seq, 40)
    manager.commit(seq, 40)
    for _ in range(9):  # decode to 49 tokens: the next query at 49 reads [44, 49] and [33, 49]
        assert manager.allocate(seq, 1)
        manager.commit(seq, 1)
        seq.output_ids.append(7)
    full, narrow, wide = manager.rows(seq)
    assert NOT_RESIDENT not in full and len(full) == math.ceil(49 / page)
    live = [[p != NOT_RESIDENT for p in row] for row in (narrow, wide)]
    # window W at position 49 (page boundary 48): pages from (48 - W + 1) // page on are live
    assert live[0].index(True) == (48 - 6 + 1) // page and live[1].index(True) == (48 - 17 + 1) // page
    assert all(live[0][live[0].index(True) :]) and all(live[1][live[1].index(True) :])
    tables = build_page_tables([seq], [manager.rows(seq)], [1], page)
    assert len(tables.page_tables) == 3 and [t[0].tolist() for t in tables.page_tables] == [
        full,
        narrow,
        wide,
    ]
    manager.check_integrity([seq])
    manager.release(seq)
    assert all(p.num_used == 0 for p in kv.pools)
