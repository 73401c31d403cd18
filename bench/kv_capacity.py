"""KV capacity: sequences held per GiB by the SWA-aware cache vs a uniform all-layers allocation.

    python -m bench.kv_capacity [--budget-gib 512] [--chunk 8192] [--json out.json] [--quick]

The layer plan is MiMo-V2.5-Pro's as the MiMo-V2.5 report describes it: 70 layers, 10 full
attention and 60 sliding window, window 128. Its KV head shapes are not public, so we take
MiMo-V2-Flash's (the architecture this project implements): 4 KV heads on full layers, 8 on SWA
layers, head_dim 192 (K), v_head_dim 128 (V), bf16. A second plan gives SWA layers the same 4
heads (the "1/7 of full attention" accounting in the report): a lower bound on the gain.

All contenders run the real allocator without tensors (``PagePool`` / ``GroupBlocks`` +
``KVManager`` in metadata-only use) over the same byte budget; each sequence is prefilled in
chunks and takes one decode step, and the SWA-aware manager drops SWA pages that left the window
as it goes:

- shared: one block pool both groups draw from (``kv_blocks``: what the engine allocates by
  default), with no split to tune;
- dual pool: a pool per group, the budget split so both run out together at exactly the
  benchmark's context length (``plan_group_pools`` with ``balance_context_len``: the best a fixed split
  can do, known in advance here and never in service);
- uniform: the same manager with ``window_aware=False`` and pools split by bytes per token, i.e.
  every layer keeps every token (what an SWA-unaware engine allocates).

Sequences are admitted until the next one no longer fits; the count divided by the budget is the
capacity. The closed-form estimate is printed next to it as a check.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import NamedTuple

from bench.common import add_common_args, format_machine, machine_info, print_table, write_json
from llm_core.caches.kv_blocks import GroupBlocks, plan_block_layout
from llm_core.caches.kv_group_manager import FullAttentionManager, SlidingWindowManager
from llm_core.caches.kv_groups import window_pages
from llm_core.caches.kv_manager import KVManager
from llm_core.caches.kv_pool import KVCacheConfig, KVLayout, plan_group_pools
from llm_core.caches.page_pool import PagePool
from llm_core.request import Sequence

GIB = 1 << 30
PAGE = 16
WINDOW = 128
MIXED = (2048, 8192, 32768)  # context lengths of the mixed rows, in turn


def pro_layout(swa_kv_heads: int = 8) -> KVLayout:
    full_layers = set(range(0, 70, 7))  # 10 full layers; their positions do not change sizing
    return KVLayout.hybrid(
        [None if i in full_layers else WINDOW for i in range(70)],
        full_kv_heads=4,
        window_kv_heads=swa_kv_heads,
        head_dim=192,
        v_head_dim=128,
        dtype_bytes=2,
    )


def metadata_kv(
    layout: KVLayout,
    budget: int,
    swa_aware: bool,
    *,
    balance_context_len: int,
    swa_headroom_tokens: int,
    enable_prefix_cache: bool = True,
    shared: bool = False,
) -> KVManager:
    """A tensor-free ``KVManager`` over ``budget`` bytes, for allocator-level benchmarks.

    ``shared``: one block pool for both groups (SWA-aware). Else SWA-aware: the pools split so both run out together at ``balance_context_len`` tokens (plus
    ``swa_headroom_tokens`` of SWA pages for chunks in flight). Not aware: split by bytes per
    token, i.e. every layer keeps every token, as an SWA-unaware engine allocates.
    """
    if shared:
        blocks_layout = plan_block_layout(layout.groups, PAGE)
        blocks = PagePool(blocks_layout.num_blocks(budget, layout.dtype_bytes), PAGE, "blocks")
        full_k, swa_k = blocks_layout.blocks_per_page
        return KVManager(
            [
                FullAttentionManager(GroupBlocks(blocks, full_k, "full")),
                SlidingWindowManager(GroupBlocks(blocks, swa_k, "swa"), WINDOW),
            ],
            enable_prefix_cache=enable_prefix_cache,
        )
    if swa_aware:
        cfg = KVCacheConfig(
            budget, PAGE, balance_context_len=balance_context_len, window_headroom_tokens=swa_headroom_tokens
        )
    else:
        frac = layout.bytes_per_token(sliding=True) / (
            layout.bytes_per_token(sliding=False) + layout.bytes_per_token(sliding=True)
        )
        cfg = KVCacheConfig(budget, PAGE, window_fraction=frac)
    num_full, num_window = plan_group_pools(layout.groups, cfg)
    return KVManager(
        [
            FullAttentionManager(PagePool(num_full, PAGE, "full")),
            SlidingWindowManager(PagePool(num_window, PAGE, "swa"), WINDOW),
        ],
        enable_prefix_cache=enable_prefix_cache,
        window_aware=swa_aware,
    )


def held_sequences(
    layout: KVLayout,
    budget: int,
    context: int | tuple[int, ...],
    chunk: int,
    swa_aware: bool,
    shared: bool = False,
    balance: int | None = None,
) -> tuple[int, float]:
    """Admit sequences of ``context`` tokens (a tuple: those lengths in turn) until one does not
    fit; (count, seconds spent). A split pool runs out on both sides together at ``balance``
    tokens (default: the context, known in advance), with one prefill chunk in flight on top
    (sequences are prefilled one at a time here)."""
    lengths = context if isinstance(context, tuple) else (context,)
    kv = metadata_kv(
        layout,
        budget,
        swa_aware,
        balance_context_len=(balance or lengths[0]) + 1,
        swa_headroom_tokens=chunk + WINDOW + PAGE,
        enable_prefix_cache=False,
        shared=shared,
    )
    held: list[Sequence] = []
    t0 = time.perf_counter()
    while True:
        n = lengths[len(held) % len(lengths)]
        seq = Sequence(len(held), [0] * (n - 1) + [1])  # distinct requests; contents do not matter
        ok = True
        while seq.in_prefill and ok:
            n = min(chunk, seq.num_uncomputed_tokens)
            ok = kv.allocate(seq, n)
            if ok:
                kv.commit(seq, n)
        if ok:  # the first decode step (the token sampled from the prompt)
            seq.output_ids.append(2)
            ok = kv.allocate(seq, 1)
            if ok:
                kv.commit(seq, 1)
        if not ok:
            kv.release(seq, cache=False)
            break
        held.append(seq)
    dt = time.perf_counter() - t0
    kv.check_integrity(held)
    return len(held), dt


class Held(NamedTuple):
    """Sequences each contender held over one budget, and the seconds the three runs took."""

    shared: int
    dual: int
    uniform: int
    seconds: float

    def over_uniform(self, n: int) -> float:
        """How many times the uniform allocation's count ``n`` is."""
        return n / self.uniform if self.uniform else float("inf")

    def per_gib(self, gib: float) -> dict[str, float]:
        return {
            "shared_seqs": self.shared,
            "dual_seqs": self.dual,
            "uniform_seqs": self.uniform,
            "shared_seqs_per_gib": self.shared / gib,
            "dual_seqs_per_gib": self.dual / gib,
            "uniform_seqs_per_gib": self.uniform / gib,
        }


def held_three_ways(
    layout: KVLayout, budget: int, context: int | tuple[int, ...], chunk: int, balance: int | None = None
) -> Held:
    """The shared block pool, the split pools (balanced at ``balance``, default the context) and
    the uniform allocation over the same sequences."""
    shared, t_shared = held_sequences(layout, budget, context, chunk, swa_aware=True, shared=True)
    dual, t_dual = held_sequences(layout, budget, context, chunk, swa_aware=True, balance=balance)
    uni, t_uni = held_sequences(layout, budget, context, chunk, swa_aware=False)
    return Held(shared, dual, uni, t_shared + t_dual + t_uni)


def table_row(plan: str, context: str, held: Held, closed_form: float, gib: float) -> list[object]:
    return [
        plan,
        context,
        held.shared / gib,
        held.dual / gib,
        held.uniform / gib,
        held.over_uniform(held.shared),
        held.over_uniform(held.dual),
        closed_form,
        held.shared,
        held.dual,
        held.uniform,
        held.seconds,
    ]


def estimate(layout: KVLayout, context: int, swa_aware: bool) -> float:
    """Closed-form bytes per held sequence, for the table's sanity column."""
    tokens = math.ceil((context + 1) / PAGE) * PAGE
    if not swa_aware:
        return tokens * (layout.bytes_per_token(sliding=False) + layout.bytes_per_token(sliding=True))
    swa = window_pages(WINDOW, PAGE) * PAGE
    return tokens * layout.bytes_per_token(sliding=False) + swa * layout.bytes_per_token(sliding=True)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(parser)
    parser.add_argument(
        "--budget-gib", type=float, default=512.0, help="KV byte budget (e.g. 8 GPUs x 64 GiB)"
    )
    parser.add_argument("--chunk", type=int, default=8192, help="prefill chunk in tokens")
    args = parser.parse_args(argv)
    contexts = [8192, 32768] if args.quick else [8192, 32768, 131072]
    budget = int((32.0 if args.quick else args.budget_gib) * GIB)
    plans = {"swa-2x-heads": pro_layout(8), "swa-equal-heads": pro_layout(4)}

    rows = []
    results = []
    ratios: dict[str, dict[int, float]] = {}  # dual pool / uniform
    shared_ratios: dict[str, dict[int, float]] = {}  # shared block pool / uniform
    mixed: dict[str, float] = {}  # shared / dual on mixed lengths
    for name, layout in plans.items():
        gib = budget / GIB
        for ctx in contexts:
            held = held_three_ways(layout, budget, ctx, args.chunk)
            est = estimate(layout, ctx, False) / estimate(layout, ctx, True)
            ratios.setdefault(name, {})[ctx] = held.dual / held.uniform if held.uniform else float("inf")
            shared_ratios.setdefault(name, {})[ctx] = (
                held.shared / held.uniform if held.uniform else float("inf")
            )
            rows.append(table_row(name, f"{ctx // 1024}K", held, est, gib))
            results.append(
                {
                    "plan": name,
                    "context": ctx,
                    **held.per_gib(gib),
                    "shared_ratio": shared_ratios[name][ctx],
                    "ratio": ratios[name][ctx],
                    "closed_form_ratio": est,
                    "full_bytes_per_token": layout.bytes_per_token(sliding=False),
                    "swa_bytes_per_token": layout.bytes_per_token(sliding=True),
                }
            )
        # Mixed lengths, the split tuned as the engine tunes it (for 8K: ``min(max_model_len,
        # 8192)``): no fixed split fits them all, the shared pool needs none.
        held = held_three_ways(layout, budget, MIXED, args.chunk, balance=8192)
        mixed[name] = held.shared / held.dual
        rows.append(table_row(name, "mixed", held, float("nan"), gib))
        results.append({"plan": name, "context": list(MIXED), **held.per_gib(gib)})
    machine = machine_info()
    print_table(
        f"KV capacity, 70 layers (10 full + 60 SWA, window {WINDOW}), budget {budget / GIB:.0f} GiB, page {PAGE}",
        [
            "plan",
            "context",
            "shared seq/GiB",
            "dual seq/GiB",
            "uniform seq/GiB",
            "shared ratio",
            "dual ratio",
            "closed form",
            "shared",
            "dual",
            "uniform",
            "sim s",
        ],
        rows,
        caption=format_machine(machine),
    )
    main_plan = next(iter(plans))
    summary: dict[str, object] = {
        "capacity_ratio_8k": ratios[main_plan][8192],
        "capacity_ratio_32k": ratios[main_plan][32768],
        "capacity_ratio_32k_equal_heads": ratios["swa-equal-heads"][32768],
        "shared_capacity_ratio_8k": shared_ratios[main_plan][8192],
        "shared_capacity_ratio_32k": shared_ratios[main_plan][32768],
        "shared_capacity_ratio_32k_equal_heads": shared_ratios["swa-equal-heads"][32768],
        "shared_over_dual_mixed": mixed[main_plan],
        "shared_over_dual_mixed_equal_heads": mixed["swa-equal-heads"],
    }
    if 131072 in ratios[main_plan]:
        summary["capacity_ratio_128k"] = ratios[main_plan][131072]
        summary["shared_capacity_ratio_128k"] = shared_ratios[main_plan][131072]
    write_json(args.json, summary=summary, results=results, machine=machine, config=vars(args))
    print(summary)
    return summary


if __name__ == "__main__":
    main()
