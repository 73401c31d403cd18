"""bench.mtp: speculative decoding with the embedded default's MTP heads: output tokens/s and mean
acceptance length for k = 0 (no speculation), 1, 2, 3 draft steps at batch 1, 8 and 32, in one run.

Each (k, batch) runs greedy requests of random byte prompts (64-256 tokens, ``--max-tokens``
output tokens, ignore_eos), ``batch`` at a time and at least ``MIN_REQUESTS`` in all, through an
in-process engine of the embedded default model (``llm_core.tools.default_llm``; its heads
come with the checkpoint, distilled when it was built). Every request's ids are checked against
k = 0's (speculation never changes greedy output). Tokens/s is output tokens over the wall time
of the requests, after one warm-up request per engine; the engines of every k run side by side and each repeat runs them all on the
same prompts in turn, a row giving the median repeat (``--repeats``). ``summary.speedup_batch1``
is k = best's tokens/s over k = 0's at batch 1 (target >= 1.5), ``summary.acceptance_length`` its
mean tokens per verify step.

    python -m bench.mtp [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import torch

from bench.common import add_common_args, format_machine, machine_info, print_table, write_json
from llm_core.models.decoder import DecoderForCausalLM
from llm_core.serving.engine import LLMEngine
from llm_core.serving.sampling import SamplingParams
from llm_core.serving.server_config import EngineConfig
from llm_core.tools.default_llm import ensure_default_checkpoint

# Requests per (k, batch, repeat) at least: batch 1 runs this many one after another.
MIN_REQUESTS = 8


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


def weight_mib_per_token(engine: LLMEngine, batch: int, k: int, acceptance_length: float) -> float:
    """Weight bytes one step reads per output token (MiB), the bound of a step whose time is the
    time to stream its weights: the target's weights (routed experts: only those its batch * (k + 1)
    tokens are expected to pick, each token taking ``num_experts_per_tok`` of ``n_routed_experts``
    uniformly), once; then each of k heads and its lm_head product, once. A verify step reads more
    experts than a 1-token step (at batch 1, 5.5 of 8 for 4 tokens instead of 2): on a machine where
    decode streams weights, drafts pay off only when the acceptance length outgrows that."""
    model = engine.runner.model
    assert isinstance(model, DecoderForCausalLM), type(model)
    cfg = model.config
    e, pick = cfg.n_routed_experts, cfg.num_experts_per_tok
    tokens = batch * (k + 1)
    touched = 1.0 - ((e - pick) / e) ** tokens  # the fraction of a layer's experts some token picks
    fixed = experts = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:  # a few rows of it are read
            continue
        if ".experts." in name:
            experts += p.numel() * p.element_size()
        else:
            fixed += p.numel() * p.element_size()
    per_step = fixed + experts * touched
    spec = engine.runner.speculator
    if spec is not None and k > 0:
        head = sum(p.numel() * p.element_size() for p in spec.heads.heads()[0].parameters())
        lm_head = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
        per_step += k * (head + lm_head)
    return per_step / (batch * acceptance_length) / 2**20


def _run_waves(
    engine: LLMEngine, prompts: list[list[int]], batch: int, max_tokens: int
) -> tuple[float, list[list[int]]]:
    """The prompts ``batch`` at a time (a wave starts when the previous one ended): total wall time
    and every request's ids."""
    wall, ids = 0.0, []
    for i in range(0, len(prompts), batch):
        w, got = _run_batch(engine, prompts[i : i + batch], max_tokens)
        wall += w
        ids += got
    return wall, ids


def run(ks: list[int], batches: list[int], max_tokens: int, seed: int, repeats: int) -> list[dict[str, Any]]:
    """Every (k, batch) ``repeats`` times, interleaved (each repeat runs every k on the same prompts
    before the next repeat, the k going first rotating), so that a slow spell of a shared machine
    hits all k alike; a row reports the median repeat's tokens/s."""
    engines: dict[int, LLMEngine] = {}
    try:
        for k in ks:
            cfg = EngineConfig(
                kv_memory_bytes=256 << 20, max_num_seqs=max(batches), max_model_len=1024, speculative_steps=k
            )
            engine = engines[k] = LLMEngine.from_checkpoint(ensure_default_checkpoint(), cfg)
            engine.start()
            _run_batch(engine, _prompts(1, seed + 999), 8)  # warm-up: first-call costs off the clock
        rates: dict[tuple[int, int], list[float]] = {(k, b): [] for k in ks for b in batches}
        rows: dict[tuple[int, int], dict[str, Any]] = {}
        for rep in range(repeats):
            for b in batches:
                # at least MIN_REQUESTS requests, in waves of b: how fast drafts are accepted varies
                # much from prompt to prompt, and one request is too few to say
                prompts = _prompts(max(b, MIN_REQUESTS), seed + 1000 * rep + b)
                outputs: dict[int, list[list[int]]] = {}
                order = ks[rep % len(ks) :] + ks[: rep % len(ks)]  # which k goes first rotates
                for k in order:
                    spec = engines[k].runner.speculator
                    before = spec.counters() if spec is not None else None
                    wall, outputs[k] = _run_waves(engines[k], prompts, b, max_tokens)
                    rates[k, b].append(sum(len(x) for x in outputs[k]) / wall)
                    row = rows.setdefault(
                        (k, b),
                        {"k": k, "batch": b, "identical": True, "accepted": 0, "proposed": 0, "steps": 0},
                    )
                    if spec is not None and before is not None:
                        after = spec.counters()
                        row["steps"] += after.verify_steps - before.verify_steps
                        row["accepted"] += after.accepted - before.accepted
                        row["proposed"] += after.proposed - before.proposed
                for k in ks:  # every k against the first (0: no speculation)
                    rows[k, b]["identical"] = rows[k, b]["identical"] and outputs[k] == outputs[ks[0]]
    finally:
        for engine in engines.values():
            engine.stop()
    out: list[dict[str, Any]] = []
    for (k, b), row in rows.items():
        steps = row.pop("steps")
        accepted, proposed = row.pop("accepted"), row.pop("proposed")
        row["tokens_per_s"] = statistics.median(rates[k, b])
        row["tokens_per_s_repeats"] = rates[k, b]
        row["acceptance_length"] = (accepted + steps) / steps if steps else 1.0
        if k > 0:
            row["draft_acceptance_rate"] = accepted / max(1, proposed)
        row["weight_mib_per_token"] = weight_mib_per_token(engines[k], b, k, row["acceptance_length"])
        out.append(row)
    return sorted(out, key=lambda r: (r["k"], r["batch"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=(__doc__ or "").split("\n", 1)[0])
    add_common_args(parser)
    parser.add_argument("--steps", default="0,1,2,3", help="draft steps k to compare (0 first)")
    parser.add_argument("--batches", default="1,8,32", help="concurrent requests")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats; rows report the median")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.batches, args.max_tokens, args.repeats = "0,2", "1,4", 16, 1
    torch.manual_seed(args.seed)
    ks = [int(x) for x in args.steps.split(",")]
    assert ks[0] == 0, "the first k is the baseline: 0"
    batches = [int(x) for x in args.batches.split(",")]
    rows = run(ks, batches, args.max_tokens, args.seed, args.repeats)
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["k"] == 0}
    base_mib = {r["batch"]: r["weight_mib_per_token"] for r in rows if r["k"] == 0}
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / base[r["batch"]]
    machine = format_machine(machine_info())
    print_table(
        "speculative decoding with the MTP heads: output tokens/s, greedy, embedded default model",
        [
            "k",
            "batch",
            "tokens/s",
            "speedup vs k=0",
            "acceptance length",
            "weight MiB/token",
            "identical ids",
        ],
        [
            [
                r["k"],
                r["batch"],
                r["tokens_per_s"],
                r["speedup"],
                r["acceptance_length"],
                r["weight_mib_per_token"],
                r["identical"],
            ]
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
            # k = 0's weight bytes per token over best k's: the speedup a weight-streaming step allows
            bandwidth_bound_speedup_batch1=base_mib[batches[0]] / best["weight_mib_per_token"],
        )
        print(f"batch {batches[0]}: k={best['k']} gives {best['speedup']:.2f}x k=0's tokens/s")
    write_json(args.json, machine=machine_info(), config=vars(args), results=rows, summary=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
