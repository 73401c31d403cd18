"""Prefix hits and input throughput of KV-affinity routing over several engines, against round
robin and least-load, on a multi-turn agent trace (issue #18).

One run starts, per policy, a fresh ``epd serve --llm-instances 4 --llm-router-policy P`` of the
embedded default (tiny) model on loopback (so no policy inherits another's caches), warms every
engine and the encoder, then plays the same trace (``bench.kv_affinity_trace``): ``--sessions``
sessions of ``--turns`` turns, ``--concurrency`` sessions at a time, a session's next turn sent when
its previous answer is back, every request a streamed chat with ``max_tokens`` ``--max-tokens``.

Per policy: requests, prompt tokens and cached tokens (the final usage chunk's
``prompt_tokens_details.cached_tokens``: the engine's prefix-cache hit), hit rate = cached /
prompt, input tokens/s = prompt tokens / wall time of the trace, TTFT P50/P90 (to the first chunk
with content), and per engine (the URLs from the ingress's ``/health`` ``llm_routing``; each
engine's own ``/health`` counters before and after the trace) the computed prompt tokens
(prompt - cached): its load; ``max_load_ratio`` = max engine load / mean.

The KV budget per engine (``--kv-memory-bytes 0``, the default: derived from the trace by
``bench.kv_affinity_trace.kv_budget``). Of the ``--concurrency`` sessions live at once, affinity spreads
``concurrency / engines`` over each engine, while round robin sends every live session to every
engine. The full-attention pool is sized for the system prompt plus twice the even share of live
sessions at their largest (every reply counted at 3 bytes per token, the most a reply can come
back as): affinity's engines keep their sessions' histories with room for an uneven spread, and
round robin's, which would need room for every live session, evict (8 live sessions over 4
engines by default: round robin would need nearly twice the pool). The SWA pool is sized not to bind: a
window for every cached branch point of those sessions, one per sequence in flight and a prefill
batch; so the figures measure where the histories are, not the window pool. Hence the explicit
``--llm-engine-window-fraction``: at the default's bytes the engine's own split (made for
8192-token sequences) gives 1227 full pages, room for every session round robin sends, and 149
SWA pages, little beyond the 128 of one 2048-token prefill batch.

What a hit can reach (the engine's SWA rule, ``kv_manager.py``): a prefix is reused only where its
window is resident, which a finished sequence keeps at its end and a later request that branched
off it heals at the branch point. So turn 0 hits the system prompt only on an engine where an
earlier request already healed it. And a reply that re-enters the history as other tokens than
were generated (the tiny model's invalid UTF-8 comes back as U+FFFD) makes turn t diverge from
turn t-1's cached sequence inside that reply: turn t reuses all of it when the divergence falls in
the sequence's last page (where its window is kept), else only up to the branch point turn t-1
healed, near the end of turn t-2's prompt. ``hit rate by turn`` and the JSON's per-request
``turns`` show both.

``--repeats N`` plays N rounds of every policy, interleaved (affinity, round robin, ..., affinity,
...), each on a fresh service: the trace runs ~10 s, and on a small machine one policy's input
tokens/s spreads ~40% between runs. The summary's gains and load ratio are then the medians of the
rounds' (``rounds`` holds each round's).

``summary``: ``hit_rate_gain`` and ``input_throughput_gain`` (affinity / round robin - 1),
``max_load_ratio`` (affinity's), the same gains against least-load, the raw figures per policy,
and per target whether it is met (None when a policy it needs was not run or had failed requests).

    python -m bench.kv_affinity [--sessions 16] [--turns 6] [--concurrency 8] [--max-tokens 16]
                                [--engines 4] [--policies affinity,round_robin,least_load]
                                [--kv-memory-bytes 0] [--repeats 1] [--json out.json] [--quick]
                                [--backend vllm]   (vLLM servers: bench.kv_affinity_vllm; summary
                                                    adds vllm_hit_gain, vllm_input_tps_gain,
                                                    vllm_max_mean_load)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

from bench.common import add_common_args, format_machine, machine_info, percentiles, print_table, write_json
from bench.kv_affinity_trace import (
    Trace,
    TraceConfig,
    kv_budget,
    make_trace,
    system_tokens,
    turn_messages,
    warm_up_image,
)
from bench.service_proc import ServiceProcess, free_port
from epd.llm_routing.policy import POLICIES

TARGET_HIT_RATE_GAIN = 0.25  # affinity's hit rate at least +25% relative to round robin's
TARGET_INPUT_THROUGHPUT_GAIN = 0.30  # and its input tokens/s at least +30%
TARGET_MAX_LOAD_RATIO = 1.5  # with no engine above 1.5x the mean load


class EngineShare(NamedTuple):
    url: str
    routed: int  # requests the router sent here during the trace
    prompt_tokens: int  # from the engine's /health counters, trace only
    cached_tokens: int
    predicted_cached_tokens: int  # the router's prediction for the requests recorded here
    actual_cached_tokens: int  # what the engine reported for them, as the router summed it

    @property
    def load(self) -> int:
        """Prompt tokens the engine computed."""
        return self.prompt_tokens - self.cached_tokens


class TurnRecord(NamedTuple):
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    seconds: float
    error: str | None


class PolicyResult(NamedTuple):
    policy: str
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    wall_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    engines: tuple[EngineShare, ...]
    hit_rate_by_turn: tuple[float, ...]
    index_modes: tuple[str, ...]  # each engine's index in the router: "events" or "approximate"
    turns: tuple[TurnRecord, ...] = ()  # every request, in the order the answers came back

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def input_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def max_load_ratio(self) -> float:
        loads = [e.load for e in self.engines]
        mean = sum(loads) / len(loads) if loads else 0.0
        return max(loads) / mean if mean > 0 else 1.0

    def figures(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": self.hit_rate,
            "input_tokens_per_s": self.input_tokens_per_s,
            "wall_s": self.wall_s,
            "ttft_p50_ms": self.ttft_p50_ms,
            "ttft_p90_ms": self.ttft_p90_ms,
            "engine_loads": [e.load for e in self.engines],
            "max_load_ratio": self.max_load_ratio,
            "hit_rate_by_turn": list(self.hit_rate_by_turn),
        }


def policy_result(
    policy: str,
    records: Sequence[TurnRecord],
    wall_s: float,
    engines: Sequence[EngineShare],
    index_modes: Sequence[str] = (),
) -> PolicyResult:
    """Sum a policy's turn records (failed turns count as errors, not in the tokens)."""
    ok = [r for r in records if r.error is None]
    ttft = percentiles([r.ttft_s * 1e3 for r in ok]) if ok else None
    by_turn: list[float] = []
    for t in range(max((r.turn for r in ok), default=-1) + 1):
        prompt = sum(r.prompt_tokens for r in ok if r.turn == t)
        by_turn.append(sum(r.cached_tokens for r in ok if r.turn == t) / prompt if prompt else 0.0)
    return PolicyResult(
        policy,
        len(records),
        len(records) - len(ok),
        sum(r.prompt_tokens for r in ok),
        sum(r.cached_tokens for r in ok),
        wall_s,
        ttft.p50 if ttft else math.nan,
        ttft.p90 if ttft else math.nan,
        tuple(engines),
        tuple(by_turn),
        tuple(index_modes),
        tuple(records),
    )


def _gain(new: float, base: float) -> float | None:
    return new / base - 1.0 if base > 0 else None


GAIN_KEYS = ("hit_rate_gain", "input_throughput_gain", "max_load_ratio")


def _judge(out: dict[str, Any]) -> None:
    """The targets and, per target, whether ``out``'s figure meets it (None: not measured)."""
    gain, tput, ratio = (out[k] for k in GAIN_KEYS)
    targets = (TARGET_HIT_RATE_GAIN, TARGET_INPUT_THROUGHPUT_GAIN, TARGET_MAX_LOAD_RATIO)
    out["targets"] = dict(zip(GAIN_KEYS, targets, strict=True))
    out["meets_hit_rate_target"] = None if gain is None else gain >= TARGET_HIT_RATE_GAIN
    out["meets_input_throughput_target"] = None if tput is None else tput >= TARGET_INPUT_THROUGHPUT_GAIN
    out["meets_load_target"] = None if ratio is None else ratio <= TARGET_MAX_LOAD_RATIO
    verdicts = [out["meets_hit_rate_target"], out["meets_input_throughput_target"], out["meets_load_target"]]
    out["meets_all_targets"] = None if None in verdicts else all(verdicts)


def summarize(results: Mapping[str, PolicyResult]) -> dict[str, Any]:
    """Gains of affinity over round robin (and least-load), affinity's load ratio, the verdicts."""
    aff, rr, ll = (results.get(p) for p in ("affinity", "round_robin", "least_load"))
    clean = {p: r for p, r in results.items() if r.errors == 0 and r.prompt_tokens > 0}
    out: dict[str, Any] = {"hit_rate_gain": None, "input_throughput_gain": None, "max_load_ratio": None}
    if aff is not None and aff.policy in clean:
        out["max_load_ratio"] = aff.max_load_ratio
    if aff is not None and rr is not None and aff.policy in clean and rr.policy in clean:
        out["hit_rate_gain"] = _gain(aff.hit_rate, rr.hit_rate)
        out["input_throughput_gain"] = _gain(aff.input_tokens_per_s, rr.input_tokens_per_s)
    if aff is not None and ll is not None and aff.policy in clean and ll.policy in clean:
        out["vs_least_load"] = {
            "hit_rate_gain": _gain(aff.hit_rate, ll.hit_rate),
            "input_throughput_gain": _gain(aff.input_tokens_per_s, ll.input_tokens_per_s),
        }
    _judge(out)
    out["policies"] = {p: r.figures() for p, r in results.items()}
    return out


def summarize_rounds(rounds: Sequence[Mapping[str, PolicyResult]]) -> dict[str, Any]:
    """``summarize`` over several rounds (each a fresh service per policy): every gain and the load
    ratio is the median of the rounds' (a round that lacks one is left out of its median), the
    verdicts are taken on those medians, and ``rounds`` keeps each round's own summary. One round
    is ``summarize`` of it, plus ``rounds``."""
    each = [summarize(r) for r in rounds]
    out = dict(each[-1]) if len(each) == 1 else summarize({})
    for key in GAIN_KEYS:
        values = [s[key] for s in each if s[key] is not None]
        out[key] = statistics.median(values) if values else None
    _judge(out)
    out["rounds"] = [{k: s[k] for k in (*GAIN_KEYS, "policies")} for s in each]
    return out


# -- the client ----------------------------------------------------------------------------------
async def chat_turn(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, Any]], max_tokens: int
) -> tuple[str, int, int, float, str | None]:
    """One streamed chat: (reply text, prompt tokens, cached tokens, TTFT s, error or None)."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                return "", 0, 0, 0.0, f"HTTP {resp.status}: {(await resp.text())[:300]}"
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return "", 0, 0, 0.0, f"in stream: {chunk['error']}"
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {}).get("content")
                    if delta:
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        text.append(delta)
                usage = chunk.get("usage") or usage
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return "", 0, 0, 0.0, f"{type(exc).__name__}: {exc}"
    if not usage:
        return "", 0, 0, 0.0, "no usage chunk"
    # An answer with no text at all (eos first): its time to the end stands for the TTFT.
    ttft = ttft if ttft is not None else time.perf_counter() - t0
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return "".join(text), int(usage["prompt_tokens"]), cached, ttft, None


async def play(url: str, trace: Trace, concurrency: int, max_tokens: int) -> tuple[list[TurnRecord], float]:
    """The trace against ``url``: ``concurrency`` sessions at a time, turns of a session in order.
    A failed turn ends its session (the next turn would need its answer)."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for s in range(len(trace.sessions)):
        queue.put_nowait(s)
    records: list[TurnRecord] = []

    async def runner(http: aiohttp.ClientSession) -> None:
        while not queue.empty():
            session = trace.sessions[queue.get_nowait()]
            replies: list[str] = []
            for t in range(len(session.turns)):
                t0 = time.perf_counter()
                reply, prompt, cached, ttft, err = await chat_turn(
                    http, url, turn_messages(trace, session, t, replies), max_tokens
                )
                records.append(
                    TurnRecord(session.index, t, prompt, cached, ttft, time.perf_counter() - t0, err)
                )
                if err is not None:
                    break
                replies.append(reply)

    timeout = aiohttp.ClientTimeout(total=600.0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(runner(http) for _ in range(min(concurrency, len(trace.sessions)))))
        return records, time.perf_counter() - t0


# -- the service ---------------------------------------------------------------------------------
def _get(url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def _post(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def wait_for_routing(base: str, engines: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """The router's engines once all ``engines`` are live with their KV event index (or, after
    ``timeout_s``, as they are: their ``mode`` goes into the result)."""
    deadline = time.monotonic() + timeout_s
    while True:
        routing = _get(f"{base}/health").get("llm_routing")
        if routing is None:
            raise SystemExit(f"bench.kv_affinity: {base}/health has no llm_routing (no engines routed?)")
        stats: list[dict[str, Any]] = routing["engines"]
        ready = len(stats) == engines and all(e["live"] and e["mode"] == "events" for e in stats)
        if ready or time.monotonic() > deadline:
            return stats
        time.sleep(0.5)


def warm_up(base: str, engine_urls: Sequence[str], seed: int) -> None:
    """Every engine's first forward, the encoder's first image and the ingress's first chat, on
    inputs that share no page with the trace."""
    for u in engine_urls:
        _post(f"{u}/v1/completions", {"prompt": list(range(1, 97)), "max_tokens": 4, "temperature": 0})
    jpeg = warm_up_image(seed)
    _post(f"{base}/v1/encode", {"items": [{"data": base64.b64encode(jpeg).decode()}]})
    _post(
        f"{base}/v1/chat/completions",
        {"messages": [{"role": "user", "content": "warm up " * 8}], "max_tokens": 4, "temperature": 0},
    )


def run_policy(
    policy: str, trace: Trace, args: argparse.Namespace, budget: tuple[int, float | None], log_dir: Path
) -> PolicyResult:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    kv_bytes, swa_fraction = budget
    cmd = [
        sys.executable, "-m", "epd.cli", "serve", "--port", str(port),
        "--llm-instances", str(args.engines), "--llm-router-policy", policy,
        "--llm-router-seed", str(args.seed), "--llm-torch-threads", "1",
        "--encoder-workers", "1", "--encoder-torch-threads", "1", "--encoder-decode-threads", "1",
        "--llm-engine-kv-memory-bytes", str(kv_bytes), "--log-level", "warning",
    ]  # fmt: skip
    if swa_fraction is not None:
        cmd += ["--llm-engine-window-fraction", repr(swa_fraction)]
    with ServiceProcess(
        f"epd serve ({policy})", cmd, base, log_dir / f"serve-{policy}.log", ready_timeout_s=300
    ):
        stats = wait_for_routing(base, args.engines)
        urls = [e["url"] for e in stats]
        warm_up(base, urls, args.seed)
        records, wall, shares, rows = measure(base, urls, trace, args, engine_counters)
    return policy_result(policy, records, wall, shares, [e["mode"] for e in rows])


def engine_counters(url: str) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) an epd engine has served, from its /health."""
    health = _get(f"{url}/health")
    return int(health["prompt_tokens_total"]), int(health["cached_prompt_tokens_total"])


def measure(
    base: str,
    urls: Sequence[str],
    trace: Trace,
    args: argparse.Namespace,
    counters: Callable[[str], tuple[int, int]],
) -> tuple[list[TurnRecord], float, list[EngineShare], list[dict[str, Any]]]:
    """The trace played against ``base``, and per engine what it served meanwhile (``counters``:
    its own prompt and cached tokens) beside the router's counts: (records, wall s, shares, the
    router's rows after)."""
    before = {u: counters(u) for u in urls}
    router_before = {e["url"]: e for e in wait_for_routing(base, args.engines, 0)}
    records, wall = asyncio.run(play(base, trace, args.concurrency, args.max_tokens))
    after = {u: counters(u) for u in urls}
    router_after = wait_for_routing(base, args.engines, 0)
    shares = []
    for e in router_after:
        u, b0 = e["url"], router_before[e["url"]]
        shares.append(
            EngineShare(
                u,
                e["routed"] - b0["routed"],
                after[u][0] - before[u][0],
                after[u][1] - before[u][1],
                e["predicted_cached_tokens"] - b0["predicted_cached_tokens"],
                e["actual_cached_tokens"] - b0["actual_cached_tokens"],
            )
        )
    return records, wall, shares, router_after


# -- report --------------------------------------------------------------------------------------
def print_results(results: Mapping[str, PolicyResult], caption: str) -> None:
    rows = [
        [
            p, r.requests, r.errors, r.prompt_tokens, r.cached_tokens, r.hit_rate, r.input_tokens_per_s,
            r.ttft_p50_ms, r.ttft_p90_ms, " / ".join(str(e.load) for e in r.engines), r.max_load_ratio,
        ]
        for p, r in results.items()
    ]  # fmt: skip
    print_table(
        "KV-affinity routing: multi-turn agent trace over the engines",
        ["policy", "requests", "errors", "prompt tok", "cached tok", "hit rate", "input tok/s",
         "TTFT P50 ms", "TTFT P90 ms", "engine loads (computed tok)", "max/mean load"],
        rows,
        caption=caption,
    )  # fmt: skip
    for p, r in results.items():
        failed = [t for t in r.turns if t.error is not None]
        if failed:
            print(f"NOTE {p}: {len(failed)} request(s) failed; the first: {failed[0].error}")
        counted = sum(e.prompt_tokens for e in r.engines)
        if counted != r.prompt_tokens:
            print(
                f"NOTE {p}: the engines counted {counted} prompt tokens, the answers' usage {r.prompt_tokens}"
            )
        print_table(
            f"{p}: per engine (index: {', '.join(sorted(set(r.index_modes))) or '?'}; "
            f"hit rate by turn: {', '.join(f'{h:.2f}' for h in r.hit_rate_by_turn)})",
            ["engine", "routed", "prompt tok", "cached tok", "load (computed)", "router predicted", "router actual"],
            [
                [e.url, e.routed, e.prompt_tokens, e.cached_tokens, e.load, e.predicted_cached_tokens,
                 e.actual_cached_tokens]
                for e in r.engines
            ],
        )  # fmt: skip


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else f"{v:{spec}}"


def _round_line(s: Mapping[str, Any]) -> str:
    return (
        f"hit rate {_fmt(s['hit_rate_gain'], '+.1%')}, input tokens/s {_fmt(s['input_throughput_gain'], '+.1%')}, "
        f"max/mean load {_fmt(s['max_load_ratio'], '.2f')}"
    )


def _verdict(v: bool | None) -> str:
    return "not measured" if v is None else "met" if v else "NOT met"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6, help="turns per session")
    parser.add_argument("--concurrency", type=int, default=8, help="sessions played at once")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of every chat")
    parser.add_argument("--system-chars", type=int, default=600, help="system prompt bytes (= tokens)")
    parser.add_argument("--image-rate", type=float, default=0.25, help="share of turns with one image")
    parser.add_argument(
        "--engines",
        type=int,
        default=None,
        help="engines (vLLM servers) per service (default: 4)",
    )
    parser.add_argument(
        "--backend",
        choices=("epd", "vllm"),
        default="epd",
        help="epd's engines, or vLLM servers behind epd serve --llm-server vllm (bench.kv_affinity_vllm)",
    )
    parser.add_argument("--vllm-max-model-len", type=int, default=4096, help="with --backend vllm")
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}"
    )
    parser.add_argument(
        "--kv-memory-bytes",
        type=int,
        default=0,
        help="KV budget per engine (0: derived from the trace, with its SWA share; see the docstring)",
    )
    parser.add_argument(
        "--swa-fraction",
        type=float,
        default=None,
        help="with --kv-memory-bytes: the SWA share (default: the engine's)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of every policy, interleaved, each a fresh service; the summary takes medians",
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="service logs (default: a temporary dir)")
    args = parser.parse_args(argv)
    if args.engines is None:
        args.engines = 4
    if args.quick:
        args.sessions, args.turns = 4, 3
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown or not policies:
        parser.error(f"--policies: unknown {unknown}; known: {', '.join(POLICIES)}")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.swa_fraction is not None and args.kv_memory_bytes <= 0:
        parser.error("--swa-fraction goes with --kv-memory-bytes (the derived budget has its own)")
    trace = make_trace(
        TraceConfig(args.sessions, args.turns, args.system_chars, image_rate=args.image_rate, seed=args.seed)
    )
    derived = kv_budget(trace, args.concurrency, args.engines, args.max_tokens)
    budget = (
        (args.kv_memory_bytes, args.swa_fraction)
        if args.kv_memory_bytes > 0
        else (derived.kv_memory_bytes, derived.swa_fraction)
    )
    print(
        f"trace: {args.sessions} sessions x {args.turns} turns ({trace.requests} requests, {trace.images} "
        f"with a new image), {args.concurrency} at once, system prompt {system_tokens(trace)} tokens"
    )
    if args.backend == "vllm":
        from bench.kv_affinity_vllm import BLOCK_SIZE, kv_blocks, model_dir

        blocks = kv_blocks(trace, args, model_dir())
        print(f"vLLM servers: {args.engines}, {blocks} KV blocks of {BLOCK_SIZE} tokens each")
    print(
        f"KV per engine: {budget[0]:,} bytes, SWA share {budget[1]}"
        + (
            f" (derived: {derived.full_pages} full pages = {derived.full_pages * derived.page_size} tokens; "
            f"an even share of the live sessions holds {derived.affinity_tokens}, every live session "
            f"{derived.round_robin_tokens}; {derived.swa_pages} SWA pages)"
            if args.kv_memory_bytes <= 0
            else ""
        )
    )
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kv-affinity-"))
    rounds: list[dict[str, PolicyResult]] = []
    for n in range(args.repeats):
        results: dict[str, PolicyResult] = {}
        for p in policies:
            t0 = time.perf_counter()
            if args.backend == "vllm":
                from bench.kv_affinity_vllm import run_policy_vllm

                results[p] = run_policy_vllm(p, trace, args, log_dir)
            else:
                results[p] = run_policy(p, trace, args, budget, log_dir)
            print(f"{p}: done in {time.perf_counter() - t0:.1f} s (service start included)", flush=True)
        rounds.append(results)
        if args.repeats > 1:
            print(f"round {n + 1} of {args.repeats}: {_round_line(summarize(results))}", flush=True)
    info = machine_info()
    for n, results in enumerate(rounds):
        caption = f"round {n + 1} of {args.repeats} | " if args.repeats > 1 else ""
        print_results(results, f"{caption}{format_machine(info)} | logs: {log_dir}")
    summary = summarize_rounds(rounds)
    if args.backend == "vllm":  # the fleet issue's keys: the same figures, on the engine users run
        summary.update(
            vllm_hit_gain=summary["hit_rate_gain"],
            vllm_input_tps_gain=summary["input_throughput_gain"],
            vllm_max_mean_load=summary["max_load_ratio"],
        )
    gain, tput, ratio = (summary[k] for k in ("hit_rate_gain", "input_throughput_gain", "max_load_ratio"))
    median = f" (median of {args.repeats} rounds)" if args.repeats > 1 else ""
    print(
        f"affinity vs round robin{median}: hit rate {_fmt(gain, '+.1%')} (target >= +{TARGET_HIT_RATE_GAIN:.0%}: "
        f"{_verdict(summary['meets_hit_rate_target'])}), input tokens/s {_fmt(tput, '+.1%')} (target >= "
        f"+{TARGET_INPUT_THROUGHPUT_GAIN:.0%}: {_verdict(summary['meets_input_throughput_target'])}); "
        f"affinity max/mean engine load {_fmt(ratio, '.2f')} (target <= {TARGET_MAX_LOAD_RATIO}: "
        f"{_verdict(summary['meets_load_target'])})"
    )
    per_round = [{p: {**r._asdict(), **r.figures()} for p, r in results.items()} for results in rounds]
    write_json(
        args.json,
        machine=info,
        config={**vars(args), "policies": policies, "kv_memory_bytes": budget[0], "swa_fraction": budget[1],
                "derived_budget": derived._asdict(), "requests": trace.requests, "images": trace.images},
        # per policy, or with --repeats a list of rounds, each per policy
        results=per_round[0] if len(per_round) == 1 else per_round,
        summary=summary,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
