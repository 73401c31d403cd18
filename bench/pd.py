"""bench.pd: decode speed while long prompts keep arriving, co-located vs prefill/decode split.

Two set-ups of the same size, each a fresh ``epd serve`` with two engine processes of the
embedded default model (one torch thread each, so the two share the machine's cores alike)::

    co-located      --llm-instances 2                                 each engine prefills and decodes
    disaggregated   --llm-prefill-instances 1 --llm-decode-instances 1  prompts on one, tokens on the other

The same load runs against both: ``--decode-streams`` clients each stream answers of
``--decode-tokens`` tokens back to back (short prompts: what a user watches), while a long prompt
(``--long-prompt-tokens``, distinct every time, 2 tokens out) arrives every ``--long-interval-s``.
TPOT is every gap between two consecutive tokens of a decode stream, as its client sees it; when a
long prefill shares a step (or the cores) with the decodes, those gaps grow. Reported: TPOT
P50/P90/P99 per set-up, the long prompts' TTFT, and ``summary.tpot_p99_ratio`` (disaggregated over
co-located: below 1 means the split keeps decoding smoother).

The second half needs no service: the bytes a split moves per request by the layer plan
(``llm_core.kv_transfer.layer_plan``), for MiMo-V2.5-Pro's plan (70 layers, 10 of them full
attention, window 128; KV heads 8 / 8 and head dims 192 / 128 in bf16, page 16 [guess: the Pro's
KV heads]) at 8K, 32K and 128K tokens, against moving every layer's KV:
``summary.kv_bytes_ratio_32k`` is all-layer over window-only.

    python -m bench.pd [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

from bench.common import add_common_args, format_machine, machine_info, percentiles, print_table, write_json
from bench.service_proc import ServiceProcess, free_port
from llm_core.caches.kv_pool import KVLayout
from llm_core.kv_transfer.layer_plan import LayerPlan

PRO_LAYERS, PRO_FULL_EVERY = 70, 7  # 10 full-attention layers (which ones does not change the bytes)
PRO_LAYOUT = KVLayout.hybrid(
    # window 129: sliding_window_size 128 previous tokens + the query
    [None if i % PRO_FULL_EVERY == 0 else 129 for i in range(PRO_LAYERS)],
    full_kv_heads=8,
    window_kv_heads=8,
    head_dim=192,
    v_head_dim=128,
    dtype_bytes=2,
)
PLAN_LENGTHS = (8192, 32768, 131072)
MODES = {
    "colocated": ["--llm-instances", "2"],
    "disaggregated": ["--llm-prefill-instances", "1", "--llm-decode-instances", "1"],
}


class ModeResult(NamedTuple):
    mode: str
    tpot_ms: list[float]  # every inter-token gap of the decode streams
    long_ttft_ms: list[float]
    decode_tokens: int
    long_prompts: int
    errors: list[str]
    kv_bytes_moved: float  # the ingress's epd_llm_kv_transfer_bytes_total


def plan_ratios() -> list[dict[str, Any]]:
    rows = []
    for n in PLAN_LENGTHS:
        plan = LayerPlan(PRO_LAYOUT, 16, n)
        rows.append(
            {
                "tokens": n,
                "window_only_bytes": plan.nbytes,
                "all_layers_bytes": plan.all_layers_nbytes,
                "ratio": plan.all_layers_nbytes / plan.nbytes,
            }
        )
    return rows


async def _stream_tokens(
    http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> tuple[list[float], str | None]:
    """Arrival times of each token of one streamed completion (one chunk per token)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    times: list[float] = []
    try:
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                return times, f"HTTP {resp.status}: {(await resp.text())[:200]}"
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return times, str(chunk["error"])
                now = time.perf_counter()
                for choice in chunk.get("choices", []):
                    times.extend([now] * len(choice.get("token_ids") or ()))
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return times, f"{type(exc).__name__}: {exc}"
    return times, None


async def _load(url: str, args: argparse.Namespace, rng: random.Random) -> ModeResult:
    tpot: list[float] = []
    long_ttft: list[float] = []
    errors: list[str] = []
    decoded = 0
    longs = 0
    stop_at = time.perf_counter() + args.seconds

    async def decode_client(http: aiohttp.ClientSession, i: int) -> None:
        nonlocal decoded
        k = 0
        while time.perf_counter() < stop_at:
            prompt = [40 + (i * 7 + k + j) % 80 for j in range(24)]
            k += 1
            times, err = await _stream_tokens(http, url, prompt, args.decode_tokens)
            if err:
                errors.append(err)
                continue
            tpot.extend((b - a) * 1e3 for a, b in itertools.pairwise(times))
            decoded += len(times)

    async def long_client(http: aiohttp.ClientSession) -> None:
        nonlocal longs
        tasks = []
        while time.perf_counter() < stop_at:
            prompt = [rng.randrange(32, 127) for _ in range(args.long_prompt_tokens)]

            async def one(p: list[int] = prompt) -> None:
                nonlocal longs
                t0 = time.perf_counter()
                times, err = await _stream_tokens(http, url, p, 2)
                if err:
                    errors.append(err)
                elif times:
                    long_ttft.append((times[0] - t0) * 1e3)
                    longs += 1

            tasks.append(asyncio.create_task(one()))
            await asyncio.sleep(args.long_interval_s)
        await asyncio.gather(*tasks)

    timeout = aiohttp.ClientTimeout(total=600.0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        await asyncio.gather(long_client(http), *(decode_client(http, i) for i in range(args.decode_streams)))
    return ModeResult("", tpot, long_ttft, decoded, longs, errors, 0.0)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def run_mode(mode: str, args: argparse.Namespace, log_dir: Path) -> ModeResult:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "epd.cli",
        "serve",
        "--port",
        str(port),
        "--llm-torch-threads",
        "1",
        "--encoder-workers",
        "1",
        "--llm-engine-max-num-batched-tokens",
        str(args.batched_tokens),
        *MODES[mode],
    ]
    url = f"http://127.0.0.1:{port}"
    with ServiceProcess(mode, cmd, url, log_dir / f"pd-{mode}.log"):
        asyncio.run(_warm(url))
        result = asyncio.run(_load(url, args, random.Random(args.seed)))
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            moved = _metric(resp.read().decode(), "epd_llm_kv_transfer_bytes_total")
    return result._replace(mode=mode, kv_bytes_moved=moved)


async def _warm(url: str) -> None:
    """Until both engines answer (the routing set fills from the health polls) and each path ran."""
    timeout = aiohttp.ClientTimeout(total=120.0)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        deadline = time.perf_counter() + 120
        while True:
            _, err = await _stream_tokens(http, url, list(range(40, 60)), 4)
            if err is None:
                break
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the service never answered: {err}")
            await asyncio.sleep(0.5)
        for i in range(4):
            await _stream_tokens(http, url, [50 + i] * 300, 2)


def summarize(results: dict[str, ModeResult], plan: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode, r in results.items():
        if r.tpot_ms:
            p = percentiles(r.tpot_ms)
            out[mode] = {"tpot_p50_ms": p.p50, "tpot_p90_ms": p.p90, "tpot_p99_ms": p.p99}
        if r.long_ttft_ms:
            q = percentiles(r.long_ttft_ms)
            out.setdefault(mode, {}).update(long_ttft_p50_ms=q.p50, long_ttft_p90_ms=q.p90)
        out.setdefault(mode, {}).update(errors=len(r.errors), kv_bytes_moved=r.kv_bytes_moved)
    co, dis = out.get("colocated", {}), out.get("disaggregated", {})
    if co.get("tpot_p99_ms") and dis.get("tpot_p99_ms"):
        out["tpot_p99_ratio"] = dis["tpot_p99_ms"] / co["tpot_p99_ms"]
        out["tpot_p50_ratio"] = dis["tpot_p50_ms"] / co["tpot_p50_ms"]
    for row in plan:
        out[f"kv_bytes_ratio_{row['tokens'] // 1024}k"] = row["ratio"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=(__doc__ or "").split("\n", 1)[0])
    add_common_args(parser)
    parser.add_argument("--seconds", type=float, default=40.0, help="load duration per set-up")
    parser.add_argument("--decode-streams", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--long-prompt-tokens", type=int, default=1536)
    parser.add_argument("--long-interval-s", type=float, default=1.5)
    parser.add_argument("--batched-tokens", type=int, default=512, help="each engine's token budget per step")
    parser.add_argument("--modes", default="colocated,disaggregated")
    parser.add_argument("--plan-only", action="store_true", help="only the layer plan's bytes (no service)")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/epd-bench-pd"))
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.decode_streams, args.long_prompt_tokens = 12.0, 2, 768
    plan = plan_ratios()
    print_table(
        "MiMo-V2.5-Pro layer plan (70 layers, 10 full, window 128, bf16): KV bytes per request",
        ["tokens", "window-only MiB", "all layers MiB", "all / window-only"],
        [
            [r["tokens"], r["window_only_bytes"] / 2**20, r["all_layers_bytes"] / 2**20, r["ratio"]]
            for r in plan
        ],
    )
    results: dict[str, ModeResult] = {}
    if not args.plan_only:
        for mode in args.modes.split(","):
            results[mode] = run_mode(mode, args, args.log_dir)
        rows = []
        for mode, r in results.items():
            p = percentiles(r.tpot_ms) if r.tpot_ms else None
            q = percentiles(r.long_ttft_ms) if r.long_ttft_ms else None
            rows.append(
                [
                    mode,
                    r.decode_tokens,
                    r.long_prompts,
                    p.p50 if p else None,
                    p.p90 if p else None,
                    p.p99 if p else None,
                    q.p50 if q else None,
                    r.kv_bytes_moved / 2**20,
                    len(r.errors),
                ]
            )
        print_table(
            f"decode TPOT with long prompts arriving ({args.decode_streams} streams, a "
            f"{args.long_prompt_tokens}-token prompt every {args.long_interval_s} s, {args.seconds:.0f} s)",
            [
                "set-up",
                "tokens",
                "long prompts",
                "TPOT P50 ms",
                "P90",
                "P99",
                "long TTFT P50 ms",
                "KV MiB moved",
                "errors",
            ],
            rows,
        )
    summary = summarize(results, plan)
    if "tpot_p99_ratio" in summary:
        print(f"TPOT P99 disaggregated / co-located: {summary['tpot_p99_ratio']:.2f}")
    print(f"KV bytes, all layers / window-only at 32K: {summary['kv_bytes_ratio_32k']:.2f}")
    print(format_machine(machine_info()))
    write_json(
        args.json,
        machine=machine_info(),
        config={k: str(v) for k, v in vars(args).items()},
        results={"plan": plan, **{m: r._asdict() for m, r in results.items()}},
        summary=summary,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
