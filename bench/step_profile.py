"""bench.step_profile: where one engine step's time goes, for a decode-only step and for a step
that also prefills a new prompt's chunk, at the concurrencies a server runs at.

    python -m bench.step_profile [--model medium] [--concurrency 8,32] [--chunks 128,2048]
                                 [--steps 16] [--dtype float32|bfloat16]
                                 [--json PATH]

The engine (``LLMEngine``, in this process, its thread not started) is driven one step at a time
by ``_step``, exactly as its thread would: schedule, forward, logits, sampling, update, publish.
For each concurrency c, c requests (prompts of ``--prompt-tokens``, greedy, ``ignore_eos``) are
prefilled first; then:

    decode           ``--steps`` steps in which every one of the c sequences decodes a token
    decode + chunk   for each ``--chunks`` size n: a new request of n prompt tokens arrives and the
                     next step decodes the c running sequences and prefills its n tokens in one
                     forward (``max_num_batched_tokens`` = c + the largest chunk), repeated
                     ``--chunk-repeats`` times (the new request is aborted after its step)

Each step's wall time is split into the decoder layers' phases, as the C layer kernel times them
(``cpu_layer.profile``: norms, qkv/o projections, attention, router, routed experts, dense MLP),
the rest of the model's forward (embedding, rotary tables, per-step buffers, final norm), the
logits (lm head), sampling, and the engine's Python (scheduling, input preparation, update,
publishing: the step minus all of the above). Rows are the mean over the steps, in ms.

``--model``: medium (``bench.llm_peer``'s 232M MiMo-V2-Flash layout, 16 experts top-2; default),
small, or a checkpoint directory. Threads: the usable cores (``--threads``), as ``epd llm`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import add_dtype_arg, format_machine, machine_info, print_table, usable_cores, write_json

PHASES = ("norms", "qkv_proj", "attention", "o_proj", "router", "routed_experts", "dense_mlp")
COLUMNS = (*PHASES, "forward_rest", "logits", "sampling", "engine_python")


class _Timed:
    """Wraps a callable, adding its wall time to ``seconds``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def model_dir(name: str) -> Path:
    if name in ("small", "medium"):
        from bench.llm_peer import model_dirs

        return model_dirs([name])[name]
    return Path(name)


class Profiler:
    """One engine, its model's forward, logits and sampler wrapped with timers."""

    def __init__(self, path: Path, max_seqs: int, budget: int, threads: int, dtype: torch.dtype) -> None:
        from llm_core.kernels import cpu_layer
        from llm_core.serving.engine import LLMEngine
        from llm_core.serving.server_config import EngineConfig

        torch.set_num_threads(threads)
        cfg = EngineConfig(
            kv_memory_bytes=512 << 20,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            max_queue_wait_s=3600.0,
            enable_prefix_cache=False,  # every chunk computes
            prefill_stall_factor=0.0,  # the whole chunk in its step (no measured bound)
        )
        self.engine = LLMEngine.from_checkpoint(path, cfg, dtype=dtype)
        runner = self.engine.runner
        model: Any = runner.model  # an nn.Module: its __call__ runs the instance's forward
        self.forward = _Timed(model.forward)
        model.forward = self.forward
        self.logits = _Timed(runner._logits)
        runner._logits = self.logits  # type: ignore[method-assign]
        self.sampler = _Timed(runner.sampling.sampler)
        runner.sampling.sampler = self.sampler  # type: ignore[assignment]
        self.layer = cpu_layer
        self.layer.profile(True)

    def reset(self) -> None:
        self.forward.seconds = self.logits.seconds = self.sampler.seconds = 0.0
        self.layer.phase_seconds(reset=True)

    def step(self) -> float:
        t0 = time.perf_counter()
        ran = self.engine._step()
        wall = time.perf_counter() - t0
        assert ran, "nothing to run"
        return wall

    def split(self, wall: float) -> dict[str, float]:
        """The time since ``reset`` by column (seconds), ``wall`` the steps' own sum."""
        phases = self.layer.phase_seconds(reset=False)
        out = {p: phases[p] for p in PHASES}
        out["forward_rest"] = self.forward.seconds - sum(phases.values())
        out["logits"] = self.logits.seconds
        out["sampling"] = self.sampler.seconds
        out["engine_python"] = wall - self.forward.seconds - self.logits.seconds - self.sampler.seconds
        return out


async def profile_level(
    prof: Profiler, c: int, prompt_tokens: int, chunks: list[int], steps: int, repeats: int, seed: int
) -> list[dict[str, Any]]:
    from llm_core.serving.sampling import SamplingParams

    rng = random.Random(seed)
    engine = prof.engine
    # as long as the model allows: the running ones must outlast every timed step
    room = engine.max_model_len - max(prompt_tokens, *chunks, 1)
    long = SamplingParams(temperature=0.0, max_tokens=min(4096, room), ignore_eos=True)
    streams = [
        engine.submit([rng.randrange(0, 256) for _ in range(prompt_tokens)], long, request_id=f"run-{i}")
        for i in range(c)
    ]
    while engine.scheduler.num_waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        prof.step()
    rows = []
    for _ in range(2):  # warm: first decode steps
        prof.step()
    prof.reset()
    walls = [prof.step() for _ in range(steps)]
    rows.append(_row(f"decode c={c}", c, 0, walls, prof.split(sum(walls))))
    for n in chunks:
        walls = []
        split: dict[str, float] = dict.fromkeys(COLUMNS, 0.0)
        for r in range(repeats):
            new = engine.submit([rng.randrange(0, 256) for _ in range(n)], long, request_id=f"chunk-{n}-{r}")
            prof.reset()
            walls.append(prof.step())
            for k, v in prof.split(walls[-1]).items():
                split[k] += v
            new.close()
            engine.abort(f"chunk-{n}-{r}")
            prof.step()  # the abort is drained; the running ones decode
        rows.append(_row(f"decode c={c} + {n}-token chunk", c, n, walls, split))
    for i, s in enumerate(streams):
        s.close()
        engine.abort(f"run-{i}")
    engine._step()  # drains the aborts
    return rows


def _row(name: str, c: int, chunk: int, walls: list[float], split: dict[str, float]) -> dict[str, Any]:
    n = len(walls)
    row: dict[str, Any] = {"step": name, "concurrency": c, "chunk_tokens": chunk, "steps": n}
    row["step_ms"] = 1e3 * sum(walls) / n
    row["step_ms_p50"] = 1e3 * statistics.median(walls)
    for k in COLUMNS:
        row[f"{k}_ms"] = 1e3 * split[k] / n
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="medium", help="medium, small or a checkpoint directory")
    ap.add_argument("--concurrency", default="8,32", help="running sequences per level")
    ap.add_argument("--chunks", default="128,2048", help="prefill chunk sizes joined to a decode step")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length of the running sequences")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per level")
    ap.add_argument("--chunk-repeats", type=int, default=3, help="steps with a chunk timed per size")
    ap.add_argument("--threads", type=int, default=0, help="torch / kernel threads (0: the usable cores)")
    ap.add_argument("--seed", type=int, default=0)
    add_dtype_arg(ap, "weights and KV storage")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",") if x]
    chunks = [int(x) for x in args.chunks.split(",") if x]
    threads = args.threads or usable_cores()
    path = model_dir(args.model)
    rows: list[dict[str, Any]] = []
    for c in levels:
        prof = Profiler(path, c + 1, c + max(chunks, default=0), threads, getattr(torch, args.dtype))
        try:
            rows += asyncio.run(
                profile_level(prof, c, args.prompt_tokens, chunks, args.steps, args.chunk_repeats, args.seed)
            )
        finally:
            prof.layer.profile(False)
    machine = machine_info()
    header = ["step", "step ms", *(c.replace("_", " ") for c in COLUMNS)]
    print_table(
        f"ms per step (mean): {path.name} ({args.dtype}), {threads} thread(s)",
        header,
        [[r["step"], round(r["step_ms"], 1), *(round(r[c + "_ms"], 1) for c in COLUMNS)] for r in rows],
        format_machine(machine),
    )
    summary = {r["step"]: round(r["step_ms"], 2) for r in rows}
    config = {
        "model": str(path),
        "threads": threads,
        "prompt_tokens": args.prompt_tokens,
        "dtype": args.dtype,
    }
    write_json(args.json, summary=summary, results=rows, machine=machine, config=config)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
