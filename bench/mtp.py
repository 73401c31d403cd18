"""bench.mtp: speculative decoding with the embedded default's MTP heads: output tokens/s and mean
acceptance length for k = 0 (no speculation), 1, 2, 3 draft steps at batch 1, 8 and 32, in one run.

Each (k, batch) runs ``batch`` concurrent greedy requests of random byte prompts (64-256 tokens,
``--max-tokens`` output tokens, ignore_eos) through an in-process engine of the embedded default
model (``LLMEngine.from_checkpoint(None)``; its heads come with the checkpoint, distilled when it
was built). Every request's ids are checked against k = 0's (speculation never changes greedy
output). Tokens/s is output tokens over the wall time of the whole batch, after one warm-up
request per engine. ``summary.speedup_batch1`` is k = best's tokens/s over k = 0's at batch 1
(target >= 1.5), ``summary.acceptance_length`` its mean tokens per verify step.

    python -m bench.mtp [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import torch

from bench.common import add_common_args, format_machine, machine_info, print_table, write_json
from llm_core.serving.engine import LLMEngine
from llm_core.serving.sampling import SamplingParams
from llm_core.serving.server_config import EngineConfig


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(rng.randrange(64, 257))] for _ in range(n)]


def _run_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(p: list[int]) -> list[int]:
        ids: list[int] = []
        async for out in engine.generate(p, sp):
            ids.extend(out.token_ids)
        return ids

    async def go() -> list[list[int]]:
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    t0 = time.perf_counter()
    ids = asyncio.run(go())
    return time.perf_counter() - t0, ids


def run(ks: list[int], batches: list[int], max_tokens: int, seed: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    reference: dict[int, list[list[int]]] = {}
    for k in ks:
        cfg = EngineConfig(
            kv_memory_bytes=256 << 20, max_num_seqs=max(batches), max_model_len=1024, speculative_steps=k
        )
        engine = LLMEngine.from_checkpoint(None, cfg)
        engine.start()
        try:
            _run_batch(engine, _prompts(1, seed + 999), 8)  # warm-up: first-call costs off the clock
            for b in batches:
                spec = engine.runner.speculator
                before = spec.counters() if spec is not None else None
                wall, ids = _run_batch(engine, _prompts(b, seed + b), max_tokens)
                if k == ks[0]:
                    reference[b] = ids
                row: dict[str, Any] = {
                    "k": k,
                    "batch": b,
                    "wall_s": wall,
                    "tokens_per_s": sum(len(x) for x in ids) / wall,
                    "identical": ids == reference[b],
                    "acceptance_length": 1.0,
                }
                if spec is not None and before is not None:
                    after = spec.counters()
                    steps = after.verify_steps - before.verify_steps
                    accepted = after.accepted - before.accepted
                    row["acceptance_length"] = (accepted + steps) / steps if steps else 0.0
                    row["draft_acceptance_rate"] = accepted / max(1, after.proposed - before.proposed)
                rows.append(row)
        finally:
            engine.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=(__doc__ or "").split("\n", 1)[0])
    add_common_args(parser)
    parser.add_argument("--steps", default="0,1,2,3", help="draft steps k to compare (0 first)")
    parser.add_argument("--batches", default="1,8,32", help="concurrent requests")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batches, args.max_tokens = "0,2", "1,4", 16
    torch.manual_seed(args.seed)
    ks = [int(x) for x in args.steps.split(",")]
    assert ks[0] == 0, "the first k is the baseline: 0"
    batches = [int(x) for x in args.batches.split(",")]
    rows = run(ks, batches, args.max_tokens, args.seed)
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["k"] == 0}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base[r["batch"]]
    machine = format_machine(machine_info())
    print_table(
        "speculative decoding with the MTP heads: output tokens/s, greedy, embedded default model",
        ["k", "batch", "tokens/s", "speedup vs k=0", "acceptance length", "identical ids"],
        [
            [r["k"], r["batch"], r["tokens_per_s"], r["speedup"], r["acceptance_length"], r["identical"]]
            for r in rows
        ],
        caption=machine,
    )
    b1 = [r for r in rows if r["batch"] == batches[0] and r["k"] > 0]
    best = max(b1, key=lambda r: r["speedup"]) if b1 else None
    summary: dict[str, Any] = {
        "identical": all(r["identical"] for r in rows),
        "speedups": {f"k{r['k']}_b{r['batch']}": r["speedup"] for r in rows if r["k"] > 0},
    }
    if best is not None:
        summary.update(
            speedup_batch1=best["speedup"],
            best_k_batch1=best["k"],
            acceptance_length=best["acceptance_length"],
            meets_target=best["speedup"] >= 1.5,
        )
        print(f"batch {batches[0]}: k={best['k']} gives {best['speedup']:.2f}x k=0's tokens/s")
    write_json(args.json, machine=machine_info(), config=vars(args), results=rows, summary=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
