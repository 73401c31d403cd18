"""Output tokens/s of the LLM engine for concurrent requests vs transformers ``generate``.

Same model (the embedded default checkpoint unless ``--model``), same prompts, greedy decoding of
``--max-tokens`` tokens per request with eos ignored, all in one run:

- engine: ``--requests`` requests submitted at once to ``LLMEngine`` (continuous batching, paged
  dual-pool KV, chunked prefill);
- transformers, batched: one ``generate`` call over all requests, left-padded to the longest
  prompt (the strongest baseline transformers offers without a serving layer);
- transformers, one at a time: ``generate`` per request (what a naive server does); measured on
  ``--sequential-sample`` requests, since its throughput does not depend on how many are queued.

``summary.speedup_vs_transformers`` is against the batched baseline (the stronger one); the
sequential ratio is reported too. Also: TTFT and inter-token latency percentiles of the engine,
how many engine outputs equal the batched transformers outputs token for token, and process CPU
seconds per output token (``summary.cpu_speedup_vs_transformers``), which other load on a shared
machine distorts far less than wall time. ``--rounds N`` alternates engine and batched runs and
reports the median round; each round draws fresh prompts (seed + round, same length range, the
same for both paths), so no round finds an earlier round's prompts in the engine's prefix cache;
the warm-up uses prompts of a seed no round uses, and ``summary.engine_cached_prompt_tokens_per_round``
counts the prompt tokens the engine served from its prefix cache in each round (0 expected).

Both paths run with the same torch intra-op thread count (``--threads``; by default one per usable
core): transformers' ops and MKL use it, and so does the engine's one-call decoder layer
(attention split by sequence, experts by expert, decode projections by column strip).

The process runs with the allocator setting every epd process starts with
(``epd.allocator.keep_freed_memory``: freed large buffers are reused, not unmapped); it applies to
the engine and transformers alike, and the table caption says whether it was in effect.

    python -m bench.llm [--requests 32] [--max-tokens 64] [--threads 0] [--rounds 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from typing import Any

import torch

from bench.common import (
    add_common_args,
    format_machine,
    machine_info,
    percentiles,
    print_table,
    usable_cores,
    write_json,
)
from epd.allocator import keep_freed_memory
from llm_core.checkpoint import load_llm
from llm_core.engine import LLMEngine
from llm_core.sampling import SamplingParams
from llm_core.server_config import EngineConfig
from llm_core.tokenizer import load_tokenizer

# The project's goal for output tokens/s with 32 concurrent requests, as a ratio to transformers.
TARGET_SPEEDUP = 5.0


def make_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (int(n_),), generator=g).tolist() for n_ in lens]


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    async def one(p: list[int]) -> tuple[list[int], list[float]]:
        ids: list[int] = []
        stamps: list[float] = []
        async for out in engine.generate(p, sp):
            ids.extend(out.token_ids)
            stamps.append(time.perf_counter())
        return ids, stamps

    async def main() -> tuple[float, list[tuple[list[int], list[float]]]]:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(p) for p in prompts))
        return t0, list(res)

    c0 = time.process_time()
    t0, results = asyncio.run(main())
    cpu = time.process_time() - c0
    wall = max(s[-1] for _, s in results) - t0
    ttft = [s[0] - t0 for _, s in results]
    itl = [b - a for _, s in results for a, b in itertools.pairwise(s)]
    return {
        "outputs": [ids for ids, _ in results],
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens": sum(len(ids) for ids, _ in results),
        "ttft": percentiles(ttft),
        "itl": percentiles(itl) if itl else None,
    }


def run_hf_batched(model: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    outputs = [row[width:].tolist() for row in out]
    return {"outputs": outputs, "wall_s": wall, "cpu_s": cpu, "tokens": sum(len(o) for o in outputs)}


def run_hf_sequential(model: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None
            )
            tokens += out.shape[1] - len(p)
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the embedded default)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--sequential-sample", type=int, default=3, help="requests timed one at a time")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate engine / batched transformers this many times; the median round is reported "
        "(on a shared machine, load drifts between phases)",
    )
    # The same intra-op thread count for both paths; by default one per usable core, so each side
    # has the whole machine (transformers' ops and MKL calls, the engine's C layer kernel: see
    # llm_core.cpu_layer.set_threads). --threads 1 compares what each does on one core.
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads, both paths (0: one per usable core)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens, args.max_prompt, args.sequential_sample = 4, 8, 64, 1
    torch.set_num_threads(args.threads if args.threads > 0 else usable_cores())
    # `epd llm` runs with this allocator setting (every epd process does); it applies to both paths.
    freed_memory_kept = keep_freed_memory()

    from transformers import MiMoV2FlashForCausalLM

    loaded = load_llm(args.model)
    hf = MiMoV2FlashForCausalLM.from_pretrained(
        loaded.model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    prompts = make_prompts(args.requests, args.min_prompt, args.max_prompt, args.seed)
    engine = LLMEngine(
        loaded.model,
        loaded.config,
        load_tokenizer(loaded.model_dir),
        EngineConfig(kv_memory_bytes=256 << 20, max_num_seqs=max(64, args.requests), max_model_len=4096),
    )
    engine.start()
    try:
        # Warm-up both paths (allocator, lazy inits) on prompts from a seed no round uses: the
        # warm-up's KV stays in the engine's prefix cache, and a round that reused its prompts
        # would be served partly from it (transformers has no such cache).
        n_rounds = max(1, args.rounds)
        warm = make_prompts(2, args.min_prompt, args.max_prompt, args.seed + n_rounds)
        run_engine(engine, warm, 4)
        run_hf_batched(hf, warm, 4)
        rounds = []
        cached_per_round: list[int] = []
        for r in range(n_rounds):
            # Fresh prompts per round: repeated ones would be prefix-cache hits for the engine only.
            ps = (
                prompts
                if r == 0
                else make_prompts(args.requests, args.min_prompt, args.max_prompt, args.seed + r)
            )
            cached_before = engine.stats().cached_prompt_tokens_total
            eng_r = run_engine(engine, ps, args.max_tokens)
            cached_per_round.append(engine.stats().cached_prompt_tokens_total - cached_before)
            rounds.append((eng_r, run_hf_batched(hf, ps, args.max_tokens)))
    finally:
        engine.stop()
    hf_s = run_hf_sequential(hf, prompts[: args.sequential_sample], args.max_tokens)

    def rate(r: dict[str, Any]) -> float:
        return r["tokens"] / r["wall_s"]

    round_speedups = [rate(e) / rate(h) for e, h in rounds]
    eng, hf_b = rounds[sorted(range(len(rounds)), key=round_speedups.__getitem__)[len(rounds) // 2]]
    # Process CPU seconds per output token: robust to other load on a shared machine (wall is not).
    cpu_speedup = (hf_b["cpu_s"] / hf_b["tokens"]) / (eng["cpu_s"] / eng["tokens"])

    same = sum(a == b for a, b in zip(eng["outputs"], hf_b["outputs"], strict=True))
    speedup = rate(eng) / rate(hf_b)
    speedup_seq = rate(eng) / rate(hf_s)
    info = {**machine_info(), "malloc_keeps_freed_memory": freed_memory_kept}
    rows = [
        ["engine", args.requests, eng["tokens"], eng["wall_s"], eng["cpu_s"], rate(eng), 1.0],
        [
            "hf batched",
            args.requests,
            hf_b["tokens"],
            hf_b["wall_s"],
            hf_b["cpu_s"],
            rate(hf_b),
            rate(hf_b) / rate(eng),
        ],
        [
            "hf one at a time",
            args.sequential_sample,
            hf_s["tokens"],
            hf_s["wall_s"],
            hf_s["cpu_s"],
            rate(hf_s),
            rate(hf_s) / rate(eng),
        ],
    ]
    print_table(
        f"LLM output throughput: {args.requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens, "
        f"{args.max_tokens} new tokens each (greedy)",
        ["path", "requests", "output tokens", "wall s", "CPU s", "tokens/s", "vs engine"],
        rows,
        caption=f"{format_machine(info)} | malloc keeps freed memory: {freed_memory_kept}",
    )
    lat = [
        ["engine TTFT ms", eng["ttft"].p50 * 1e3, eng["ttft"].p90 * 1e3, eng["ttft"].p99 * 1e3],
    ]
    if eng["itl"] is not None:
        lat.append(
            ["engine inter-token ms", eng["itl"].p50 * 1e3, eng["itl"].p90 * 1e3, eng["itl"].p99 * 1e3]
        )
    print_table("engine latency", ["metric", "P50", "P90", "P99"], lat)
    print(
        "hf = transformers generate: 'batched' = all requests in one left-padded batch; "
        "'one at a time' = a generate call per request"
    )
    print(
        f"speedup vs transformers batched: {speedup:.2f}x; vs one at a time: {speedup_seq:.2f}x; "
        f"engine outputs identical to batched transformers: {same}/{args.requests}"
    )
    if len(rounds) > 1:
        print(
            "speedup vs batched per round: "
            + ", ".join(f"{x:.2f}x" for x in round_speedups)
            + " (median shown)"
        )
    print(f"CPU time per output token, transformers batched / engine: {cpu_speedup:.2f}x")
    print(f"engine prompt tokens served from its prefix cache, per round: {cached_per_round}")
    threads = torch.get_num_threads()
    print(
        f"target >= {TARGET_SPEEDUP:.0f}x (both sides ran with {threads} torch thread(s)): "
        f"vs batched {'met' if speedup >= TARGET_SPEEDUP else 'NOT met'}, "
        f"vs one at a time {'met' if speedup_seq >= TARGET_SPEEDUP else 'NOT met'}"
    )
    write_json(
        args.json,
        machine=info,
        config=vars(args),
        results={
            "engine": {k: v for k, v in eng.items() if k != "outputs"},
            "transformers_batched": {k: v for k, v in hf_b.items() if k != "outputs"},
            "transformers_sequential": hf_s,
        },
        summary={
            "speedup_vs_transformers": speedup,
            "baseline": "transformers generate, all requests in one left-padded batch (greedy, eager attention)",
            "speedup_vs_transformers_sequential": speedup_seq,
            "round_speedups_vs_transformers": round_speedups,
            "cpu_speedup_vs_transformers": cpu_speedup,
            "target_speedup": TARGET_SPEEDUP,
            "meets_target_vs_batched": speedup >= TARGET_SPEEDUP,
            "meets_target_vs_sequential": speedup_seq >= TARGET_SPEEDUP,
            "torch_threads": threads,
            "engine_tokens_per_s": rate(eng),
            "transformers_batched_tokens_per_s": rate(hf_b),
            "transformers_sequential_tokens_per_s": rate(hf_s),
            "engine_ttft_p50_ms": eng["ttft"].p50 * 1e3,
            "engine_itl_p50_ms": eng["itl"].p50 * 1e3 if eng["itl"] else None,
            "engine_itl_p99_ms": eng["itl"].p99 * 1e3 if eng["itl"] else None,
            "outputs_identical_to_transformers": same,
            # Prompt tokens the engine served from its prefix cache, per round: 0 unless two
            # random prompts share a whole first page (the rounds and the warm-up never share
            # prompts).
            "engine_cached_prompt_tokens_per_round": cached_per_round,
            "requests": args.requests,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
