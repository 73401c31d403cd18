"""Prefix reuse on a multi-turn agent trace at a fixed KV budget: SWA-aware cache vs keep-all-SWA.

    python -m bench.prefix_reuse [--budget-gib 16 32 64 128] [--headline-gib 32] [--sessions 32] [--turns 8] [--json out.json] [--quick]

Trace: ``sessions`` agent conversations share a system prompt (tools and instructions); each turn
sends the whole history plus a new user or tool message, the model answers, and after a short
think time (a tool call) the next turn arrives. Sessions interleave, so a session's prefix must
survive in the cache while others run. Nothing is computed: the real scheduler and KV manager
run without tensors (metadata only) and a deterministic stand-in emits the output tokens.

Contenders, same byte budget, same scheduler and radix cache code:

- ``swa-aware``: the dual pool (SWA pool sized for the window of each conversation), SWA pages
  dropped as they leave the window, tombstones in the tree, hits where full KV and the window of
  SWA KV before the boundary are live;
- ``keep-all-swa``: ``window_aware=False``, every token keeps its SWA KV in the cache as an
  SWA-unaware cache must, pools split by bytes per token.

Reported per request: prompt tokens served from the cache (reused), and the tokens the model
had to compute. ``summary.reuse_gain`` is mean reused tokens per request, aware / keep-all, at
``--headline-gib`` (32 GiB: less than half of what the keep-all cache needs to hold the latest
turn of every conversation). With budgets large enough for keep-all to hold everything the gain goes to ~1:
the aware cache then loses only the one recompute that heals each branch point. The layer plan is bench.kv_capacity's (70 layers, 10 full + 60 SWA, window 128).
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field

from bench.common import add_common_args, format_machine, machine_info, print_table, write_json
from bench.kv_capacity import metadata_kv, pro_layout
from llm_core.caches.kv_pool import KVLayout
from llm_core.request import Sampled, Sequence
from llm_core.serving.scheduler import Scheduler, SchedulerConfig

GIB = 1 << 30
STEP_S = 0.02  # simulated seconds per model step (the scheduler's waiting-time term uses it)
MAX_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class TraceConfig:
    sessions: int = 32
    turns: int = 8
    system_tokens: int = 2048
    first_message: tuple[int, int] = (500, 1500)
    message: tuple[int, int] = (200, 1500)  # tool results and user follow-ups
    output: tuple[int, int] = (64, 256)
    think_steps: tuple[int, int] = (5, 60)
    concurrency: int = 8
    seed: int = 0


@dataclass
class Session:
    sid: int
    history: list[int]
    turn: int = 0
    ready_at: int = 0
    rng: random.Random = field(default_factory=random.Random)


def _tokens(rng: random.Random, span: tuple[int, int]) -> list[int]:
    return [rng.randrange(60000) for _ in range(rng.randint(*span))]


def run_trace(layout: KVLayout, budget: int, trace: TraceConfig, swa_aware: bool) -> dict[str, float]:
    """Run the whole trace through the scheduler; returns the per-run metrics."""
    # The SWA-aware pools are balanced for the trace's mean context (what a deployment would
    # measure): the middle turn's history.
    typical = trace.system_tokens + sum(trace.first_message) // 2
    typical += (trace.turns - 1) // 2 * (sum(trace.message) // 2 + sum(trace.output) // 2)
    kv = metadata_kv(
        layout, budget, swa_aware, balance_context_len=typical, swa_headroom_tokens=MAX_BATCHED_TOKENS
    )
    step = 0
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=trace.concurrency, max_num_batched_tokens=MAX_BATCHED_TOKENS, max_model_len=1 << 20
        ),
        kv,
        clock=lambda: step * STEP_S,
    )
    rng = random.Random(trace.seed)
    system = _tokens(rng, (trace.system_tokens, trace.system_tokens))
    sessions = [
        Session(i, list(system), rng=random.Random(trace.seed * 1000 + i)) for i in range(trace.sessions)
    ]
    for s in sessions:
        s.history += _tokens(s.rng, trace.first_message)
        s.ready_at = s.rng.randint(0, trace.think_steps[1])
    pending = sorted(sessions, key=lambda s: s.ready_at)
    owner: dict[int, Session] = {}
    reused: list[int] = []
    prompts: list[int] = []
    computed = 0
    t0 = time.perf_counter()
    while pending or sched.has_work():
        while pending and pending[0].ready_at <= step:
            s = pending.pop(0)
            seq = Sequence(
                f"{s.sid}.{s.turn}",
                list(s.history),
                max_new_tokens=s.rng.randint(*trace.output),
                arrival_time=step * STEP_S,  # the scheduler runs on the simulated clock
            )
            owner[id(seq)] = s
            sched.add(seq)
        batch = sched.schedule()
        if batch is None:
            step = max(step + 1, pending[0].ready_at if pending else step + 1)
            continue
        computed += sum(batch.num_new_tokens)
        sampled: list[Sampled] = [
            60000 + (s.num_tokens % 1000) if s.num_computed_tokens + n == s.num_tokens else None
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        ]
        for seq in sched.update(batch, sampled):
            s = owner.pop(id(seq))
            reused.append(seq.num_cached_tokens)
            prompts.append(seq.num_prompt_tokens)
            s.turn += 1
            if s.turn < trace.turns:
                s.history = seq.token_ids + _tokens(s.rng, trace.message)
                s.ready_at = step + s.rng.randint(*trace.think_steps)
                pending.append(s)
                pending.sort(key=lambda x: x.ready_at)
        step += 1
    kv.check_integrity([])
    n = len(reused)
    return {
        "requests": n,
        "reused_per_request": sum(reused) / n,
        "prompt_per_request": sum(prompts) / n,
        "hit_rate": sum(reused) / sum(prompts),
        "computed_tokens": computed,
        "preemptions": sched.num_preemptions,
        "steps": step,
        "full_pages": kv.full_pool.num_pages,
        "swa_pages": kv.groups[1].pool.num_pages,
        "sim_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(parser)
    parser.add_argument("--budget-gib", type=float, nargs="+", default=[16.0, 32.0, 64.0, 128.0])
    parser.add_argument(
        "--headline-gib", type=float, default=32.0, help="budget whose gain is summary.reuse_gain"
    )
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args(argv)
    if args.quick:
        trace = TraceConfig(sessions=6, turns=3, concurrency=3, system_tokens=512, seed=args.seed)
        budgets = [2.0]
        args.headline_gib = 2.0
    else:
        trace = TraceConfig(
            sessions=args.sessions, turns=args.turns, concurrency=args.concurrency, seed=args.seed
        )
        budgets = args.budget_gib
    layout = pro_layout(8)
    rows = []
    results = []
    gains = []
    for gib in budgets:
        budget = int(gib * GIB)
        aware = run_trace(layout, budget, trace, swa_aware=True)
        keep = run_trace(layout, budget, trace, swa_aware=False)
        gain = aware["reused_per_request"] / max(keep["reused_per_request"], 1.0)
        gains.append(gain)
        for name, r in (("swa-aware", aware), ("keep-all-swa", keep)):
            rows.append(
                [
                    f"{gib:g} GiB",
                    name,
                    r["reused_per_request"],
                    r["prompt_per_request"],
                    r["hit_rate"],
                    r["computed_tokens"] / 1e6,
                    r["preemptions"],
                    r["sim_s"],
                ]
            )
            results.append({"budget_gib": gib, "cache": name, **r})
        rows.append([f"{gib:g} GiB", "gain (aware / keep-all)", gain, "", "", "", "", ""])
    machine = machine_info()
    print_table(
        f"Prefix reuse, {trace.sessions} agent sessions x {trace.turns} turns, concurrency {trace.concurrency}",
        [
            "budget",
            "cache",
            "reused tok/req",
            "prompt tok/req",
            "hit rate",
            "computed Mtok",
            "preempt",
            "sim s",
        ],
        rows,
        caption=format_machine(machine),
    )
    by_budget = dict(zip(budgets, gains, strict=True))
    headline = args.headline_gib if args.headline_gib in by_budget else budgets[0]
    summary = {"reuse_gain": by_budget[headline], "budget_gib": headline, "reuse_gain_by_budget": by_budget}
    write_json(
        args.json,
        summary=summary,
        results=results,
        machine=machine,
        config={**vars(args), "trace": trace.__dict__},
    )
    print(summary)
    return summary


if __name__ == "__main__":
    main()
