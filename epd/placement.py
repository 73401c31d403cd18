"""Which cores the E stage and a local LLM server run on, so they do not fight for the same ones.

``epd serve --llm-server vllm`` starts vLLM beside epd's ingress and encoder workers. Left to the
scheduler, vLLM's inference threads (which spin while a request is in flight) and the encoders'
torch threads share every core, and each slows the other down. The split gives each its own:

    --cpu-split auto      (default) vLLM's inference threads on the upper half of the usable cores,
                          the ingress and the encoder workers on the lower half (one core at least
                          each; nothing is split on a single core)
    --cpu-split LLM:EPD   core lists, e.g. 8-15:0-7 or 1:0
    --cpu-split off       no placement

vLLM gets its cores twice: its process runs under ``taskset`` (its API server and engine core stay
off epd's cores too) and ``VLLM_CPU_OMP_THREADS_BIND`` binds its inference threads one per core.
epd's side is the serve process's own affinity, which the encoder workers it starts inherit (and
size their thread pools by: ``usable_cores``). On a GPU node the split is the host cores: see
docs/vllm.md.
"""

from __future__ import annotations

import shutil
from collections.abc import Collection, Iterable
from typing import NamedTuple


class CpuSplit(NamedTuple):
    llm: tuple[int, ...]  # the local LLM server's cores
    epd: tuple[int, ...]  # the ingress's and the encoder workers'

    def describe(self) -> str:
        return f"cpu split: vLLM inference threads on cores {cpu_list(self.llm)}, epd (ingress, encoders) on {cpu_list(self.epd)}"


def parse_cpus(text: str) -> tuple[int, ...]:
    """``"0-3,6"`` -> (0, 1, 2, 3, 6); ValueError naming the text when it is not a core list."""
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, dash, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if dash else int(lo)
            if first < 0 or last < first:
                raise ValueError(part)
            out.extend(range(first, last + 1))
    except ValueError:
        raise ValueError(f"not a core list: {text!r} (e.g. 0-3,6)") from None
    return tuple(sorted(set(out)))


def cpu_list(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 5) -> "0-2,5" (the form taskset and VLLM_CPU_OMP_THREADS_BIND take)."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def plan_split(spec: str, usable: Collection[int]) -> CpuSplit | None:
    """The split ``--cpu-split`` asks for over the ``usable`` cores (None: none). ValueError for a
    spec that names cores outside ``usable``, or gives one side none."""
    cores = tuple(sorted(usable))
    if spec == "off" or (spec == "auto" and len(cores) < 2):
        return None
    if spec == "auto":
        half = len(cores) // 2
        return CpuSplit(cores[half:], cores[:half])
    llm_text, colon, epd_text = spec.partition(":")
    if not colon:
        raise ValueError(f"--cpu-split takes auto, off or LLM_CORES:EPD_CORES, got {spec!r}")
    split = CpuSplit(parse_cpus(llm_text), parse_cpus(epd_text))
    outside = set(split.llm + split.epd) - set(cores)
    if outside:
        raise ValueError(
            f"--cpu-split names cores {cpu_list(outside)} this process cannot use ({cpu_list(cores)})"
        )
    return split


def pinned_argv(argv: tuple[str, ...], cpus: tuple[int, ...]) -> tuple[str, ...]:
    """``argv`` run on ``cpus`` only (under taskset; as it is where taskset is missing, or with no
    cores named: anywhere)."""
    taskset = shutil.which("taskset")
    return (taskset, "-c", cpu_list(cpus), *argv) if taskset and cpus else argv
