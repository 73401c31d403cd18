"""``bench.kv_affinity --backend vllm``: the same trace and policies over several vLLM servers (the
CPU build, ``make vllm-peer``) behind one ``epd serve --llm-server vllm``.

Per policy a fresh set of servers (no policy inherits another's caches), each started as a team
would start it for epd's router: ``--enable-mm-embeds``, ``--prefix-caching-hash-algo
sha256_cbor``, ``--enable-prompt-tokens-details``, its KV events on two loopback ports, and its
inference threads bound to a core of their own (``VLLM_CPU_OMP_THREADS_BIND``, servers over the
cores in turn). The checkpoint is ``bench.vlm_peer``'s tiny Qwen2.5-VL (its pipeline spec).

The KV blocks per server hold the system prompt and an even share of the live sessions at their
largest plus a quarter of the rest (``kv_affinity_trace.kv_budget``'s figures), converted from the
trace's byte-tokens to the checkpoint's tokens (its tokenizer on the system prompt): affinity keeps
its sessions' histories, round robin, which would need every live session on every server,
evicts. Per server, the prompt tokens it computed come from vLLM's own counters
(``vllm:prompt_tokens_total`` - ``vllm:prefix_cache_hits_total`` on its /metrics).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.kv_affinity_trace import Trace, kv_budget, system_tokens
from bench.service_proc import ServiceProcess, free_port

BLOCK_SIZE = 32  # the CPU attention takes multiples of 32; its default 128 leaves the trace few whole blocks
_METRIC = re.compile(r"^(vllm:prompt_tokens_total|vllm:prefix_cache_hits_total)\{[^}]*\} ([0-9.e+]+)$", re.M)


def model_dir() -> Path:
    from bench.vlm_peer import ensure_checkpoint, pipeline_spec

    return ensure_checkpoint(pipeline_spec())


def kv_blocks(trace: Trace, args: argparse.Namespace, directory: Path) -> int:
    """The per-server KV blocks of the derived budget, in the checkpoint's tokens (the CPU build
    sizes its KV space in whole GiB only, so the bench sets the block count:
    ``--num-gpu-blocks-override``, which vLLM applies on CPU as well)."""
    from llm_core.prompts.tokenizer import load_tokenizer

    derived = kv_budget(trace, args.concurrency, args.engines, args.max_tokens)
    # an even share of the live sessions and a quarter of the rest: with 2 servers, "twice the even
    # share" (the epd bench's room for an uneven spread over 4 engines) would be every session
    even, every = derived.affinity_tokens, derived.round_robin_tokens
    byte_tokens = even + (every - even) // 4
    ratio = len(load_tokenizer(str(directory)).encode_text(trace.system)) / max(1, system_tokens(trace))
    tokens = max(math.ceil(byte_tokens * ratio), args.vllm_max_model_len)
    # + 1: vLLM keeps one block of the pool as its null block (a pool of exactly max_model_len
    # tokens is refused at start: "the estimated maximum model length is 4064")
    return math.ceil(tokens / BLOCK_SIZE) + 1


def vllm_counters(url: str) -> tuple[int, int]:
    """(prompt tokens, prefix-cache hit tokens) from a vLLM server's /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = {name: int(float(v)) for name, v in _METRIC.findall(text)}
    return found.get("vllm:prompt_tokens_total", 0), found.get("vllm:prefix_cache_hits_total", 0)


def start_servers(
    stack: ExitStack, directory: Path, blocks: int, args: argparse.Namespace, log_dir: Path, tag: str
) -> list[tuple[str, str]]:
    """``args.engines`` vLLM servers: (url, "events,replay") each."""
    from epd.llm_servers.vllm_launch import VLLMLaunch, VLLMProcess
    from epd.llm_servers.vllm_routing import local_kv_events, remove_local

    cores = sorted(os.sched_getaffinity(0))
    out = []
    for i in range(args.engines):
        events = local_kv_events()
        stack.callback(remove_local, events)  # after the server stops (callbacks run in reverse)
        launch = VLLMLaunch(
            str(directory),
            free_port(),
            dtype="float32",
            max_model_len=args.vllm_max_model_len,
            kv_cache_gib=1.0,
            extra_args=(
                "--block-size",
                str(BLOCK_SIZE),
                "--num-gpu-blocks-override",
                str(blocks),
                "--max-num-seqs",
                "16",
                "--disable-uvicorn-access-log",
            ),
            env={"VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)])},
            kv_events=events,
        )
        server = stack.enter_context(
            VLLMProcess(launch, log_dir / f"vllm-{tag}-{i}.log", ready_timeout_s=420.0)
        )
        out.append((server.url, f"{events.endpoint},{events.replay}"))
    return out


def run_policy_vllm(policy: str, trace: Trace, args: argparse.Namespace, log_dir: Path) -> Any:
    from bench.kv_affinity import measure, policy_result, wait_for_routing

    directory = model_dir()
    blocks = kv_blocks(trace, args, directory)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with ExitStack() as stack:
        servers = start_servers(stack, directory, blocks, args, log_dir, policy)
        cmd = [
            sys.executable, "-m", "epd.cli", "serve", "--port", str(port), "--model", str(directory),
            "--llm-server", "vllm", "--llm-router-policy", policy, "--llm-router-seed", str(args.seed),
            "--vllm-block-size", str(BLOCK_SIZE), "--encoder-workers", "1", "--encoder-torch-threads", "1",
            "--encoder-decode-threads", "1", "--max-queue-wait-s", "120", "--log-level", "warning",
        ]  # fmt: skip
        for url, events in servers:
            cmd += ["--llm-url", url, "--vllm-kv-events", events]
        stack.enter_context(
            ServiceProcess(
                f"epd serve ({policy}, vLLM)",
                cmd,
                base,
                log_dir / f"serve-vllm-{policy}.log",
                ready_timeout_s=300,
            )
        )
        stats = wait_for_routing(base, args.engines)
        urls = [e["url"] for e in stats]
        warm_up(base, urls, str(directory))
        records, wall, shares, router_after = measure(base, urls, trace, args, vllm_counters)
    checks = [f"{e['mode']}/{e['naming_check']}" for e in router_after]
    return policy_result(policy, records, wall, shares, checks)


def warm_up(base: str, urls: list[str], model: str) -> None:
    """Every server's first forward and the ingress's first chat, on text no trace turn shares."""
    from bench.kv_affinity import _post

    for u in urls:
        _post(
            f"{u}/v1/completions",
            {"model": model, "prompt": "warm up " * 12, "max_tokens": 4, "temperature": 0},
        )
    _post(
        f"{base}/v1/chat/completions",
        {"messages": [{"role": "user", "content": "warm up " * 8}], "max_tokens": 4, "temperature": 0},
    )
