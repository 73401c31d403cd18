"""KV capacity: sequences held per GiB by the dual pool vs a uniform all-layers allocation.

    python -m bench.kv_capacity [--budget-gib 512] [--chunk 8192] [--json out.json] [--quick]

The layer plan is MiMo-V2.5-Pro's as the MiMo-V2.5 report describes it: 70 layers, 10 full
attention and 60 sliding window, window 128. Its KV head shapes are not public, so we take
MiMo-V2-Flash's (the architecture this project implements): 4 KV heads on full layers, 8 on SWA
layers, head_dim 192 (K), v_head_dim 128 (V), bf16. A second plan gives SWA layers the same 4
heads (the "1/7 of full attention" accounting in the report): a lower bound on the gain.

Both contenders run the real allocator without tensors (``PagePool`` + ``KVManager`` in
metadata-only use) over the same byte budget:

- dual pool: the budget split so both pools run out together at the context length
  (``plan_pools`` with ``balance_context_len``); each sequence is prefilled in chunks and takes one decode step, and
  the manager drops SWA pages that left the window as it goes;
- uniform: the same manager with ``swa_aware=False`` and pools split by bytes per token, i.e.
  every layer keeps every token (what an SWA-unaware engine allocates).

Sequences are admitted until the next one no longer fits; the count divided by the budget is the
capacity. The closed-form estimate is printed next to it as a check.
"""

from __future__ import annotations

import argparse
import math
import time

from bench.common import add_common_args, format_machine, machine_info, print_table, write_json
from llm_core.caches.kv_group_manager import FullAttentionManager, SlidingWindowManager
from llm_core.caches.kv_manager import KVManager
from llm_core.caches.kv_pool import KVCacheConfig, KVLayout, PagePool, plan_pools, swa_pages_per_sequence
from llm_core.serving.sequence import Sequence

GIB = 1 << 30
PAGE = 16
WINDOW = 128


def pro_layout(swa_kv_heads: int = 8) -> KVLayout:
    full_layers = set(range(0, 70, 7))  # 10 full layers; their positions do not change sizing
    return KVLayout(
        layer_is_swa=tuple(i not in full_layers for i in range(70)),
        full_kv_heads=4,
        swa_kv_heads=swa_kv_heads,
        head_dim=192,
        v_head_dim=128,
        sliding_window=WINDOW,
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
) -> KVManager:
    """A tensor-free ``KVManager`` over ``budget`` bytes, for allocator-level benchmarks.

    SWA-aware: the pools split so both run out together at ``balance_context_len`` tokens (plus
    ``swa_headroom_tokens`` of SWA pages for chunks in flight). Not aware: split by bytes per
    token, i.e. every layer keeps every token, as an SWA-unaware engine allocates.
    """
    if swa_aware:
        cfg = KVCacheConfig(
            budget, PAGE, balance_context_len=balance_context_len, swa_headroom_tokens=swa_headroom_tokens
        )
    else:
        frac = layout.swa_bytes_per_token / (layout.full_bytes_per_token + layout.swa_bytes_per_token)
        cfg = KVCacheConfig(budget, PAGE, swa_fraction=frac)
    plan = plan_pools(layout, cfg)
    return KVManager(
        [
            FullAttentionManager(PagePool(plan.num_full_pages, PAGE, "full")),
            SlidingWindowManager(PagePool(plan.num_swa_pages, PAGE, "swa"), WINDOW),
        ],
        enable_prefix_cache=enable_prefix_cache,
        swa_aware=swa_aware,
    )


def held_sequences(
    layout: KVLayout, budget: int, context: int, chunk: int, swa_aware: bool
) -> tuple[int, float]:
    """Admit sequences of ``context`` tokens until one does not fit; (count, seconds spent)."""
    # Both pools run out together at this context, with one prefill chunk in flight on top
    # (sequences are prefilled one at a time here).
    kv = metadata_kv(
        layout,
        budget,
        swa_aware,
        balance_context_len=context + 1,
        swa_headroom_tokens=chunk + WINDOW + PAGE,
        enable_prefix_cache=False,
    )
    held: list[Sequence] = []
    t0 = time.perf_counter()
    while True:
        seq = Sequence(len(held), [0] * (context - 1) + [1])  # distinct requests; contents do not matter
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


def estimate(layout: KVLayout, context: int, swa_aware: bool) -> float:
    """Closed-form bytes per held sequence, for the table's sanity column."""
    tokens = math.ceil((context + 1) / PAGE) * PAGE
    if not swa_aware:
        return tokens * (layout.full_bytes_per_token + layout.swa_bytes_per_token)
    swa = swa_pages_per_sequence(WINDOW, PAGE) * PAGE
    return tokens * layout.full_bytes_per_token + swa * layout.swa_bytes_per_token


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
    ratios: dict[str, dict[int, float]] = {}
    for name, layout in plans.items():
        for ctx in contexts:
            dual, t_dual = held_sequences(layout, budget, ctx, args.chunk, swa_aware=True)
            uni, t_uni = held_sequences(layout, budget, ctx, args.chunk, swa_aware=False)
            ratio = dual / uni if uni else float("inf")
            est = estimate(layout, ctx, False) / estimate(layout, ctx, True)
            ratios.setdefault(name, {})[ctx] = ratio
            gib = budget / GIB
            rows.append(
                [name, f"{ctx // 1024}K", dual / gib, uni / gib, ratio, est, dual, uni, t_dual + t_uni]
            )
            results.append(
                {
                    "plan": name,
                    "context": ctx,
                    "dual_seqs": dual,
                    "uniform_seqs": uni,
                    "dual_seqs_per_gib": dual / gib,
                    "uniform_seqs_per_gib": uni / gib,
                    "ratio": ratio,
                    "closed_form_ratio": est,
                    "full_bytes_per_token": layout.full_bytes_per_token,
                    "swa_bytes_per_token": layout.swa_bytes_per_token,
                }
            )
    machine = machine_info()
    print_table(
        f"KV capacity, 70 layers (10 full + 60 SWA, window {WINDOW}), budget {budget / GIB:.0f} GiB, page {PAGE}",
        [
            "plan",
            "context",
            "dual seq/GiB",
            "uniform seq/GiB",
            "ratio",
            "closed form",
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
    }
    if 131072 in ratios[main_plan]:
        summary["capacity_ratio_128k"] = ratios[main_plan][131072]
    write_json(args.json, summary=summary, results=results, machine=machine, config=vars(args))
    print(summary)
    return summary


if __name__ == "__main__":
    main()
