"""MKL's AVX-512 code on AMD CPUs that have it (``use_mkl_avx512``).

Torch's CPU wheels link MKL statically, and MKL picks its code path by CPU vendor before features:
on any non-Intel CPU it runs its AVX2 code. On a Zen 5 core that is half of what the core does in
float32: a [2048, 768] x [768, 1280] product runs at ~200 GFLOPS on 2 cores in AVX2, ~450 in
AVX-512 (oneDNN, which vLLM's CPU build calls, reaches the same ~450). Every float32 linear of the
LLM engine and the encoder towers, and the C kernels' products of many rows (``_blas.h``, torch's
own ``sgemm_``), go through it.

MKL asks whether the CPU is Intel's through one exported function; a definition loaded into the
process's global scope before torch is loaded answers first (``epd_common/_mkl_cpu.c``). MKL then picks
its code path from the CPU's features, as on Intel CPUs. Applied only where that path's
instructions are all there (AVX-512 F, DQ, BW, VL) and the vendor is AMD; everywhere else it does
nothing. ``EPD_MKL_AVX512=0`` turns it off. Results keep float32 accuracy; their last bits differ
from the AVX2 path's (another summation order), and torch's linear and the C kernels, which share
the one MKL, still agree with each other bit for bit.

Torch-free on purpose: it must run before torch is imported. ``epd.cli`` applies it first in every
role process, and the benchmarks and tests do the same, so that they measure what the service runs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import NamedTuple

from epd_common import native

# the instructions MKL's AVX-512 (Skylake-server class) code uses
AVX512_FLAGS = ("avx512f", "avx512dq", "avx512bw", "avx512vl")
SHIM = "epd_common._mkl_cpu"


class MklDispatch(NamedTuple):
    applied: bool
    reason: str  # why (not), in words


def decide(cpuinfo: str, env: Mapping[str, str], torch_loaded: bool) -> MklDispatch:
    """Whether this process should let MKL pick its code path by features: ``cpuinfo`` is the
    text of /proc/cpuinfo (its first processor's vendor and flags are read)."""
    if env.get("EPD_MKL_AVX512", "1") == "0":
        return MklDispatch(False, "off (EPD_MKL_AVX512=0)")
    vendor, flags = _first_processor(cpuinfo)
    if vendor != "AuthenticAMD":
        return MklDispatch(False, f"not needed ({vendor or 'unknown vendor'}: MKL picks by features)")
    missing = [f for f in AVX512_FLAGS if f not in flags]
    if missing:
        return MklDispatch(False, f"not applied (the CPU lacks {', '.join(missing)}: MKL's AVX2 code it is)")
    if torch_loaded:
        return MklDispatch(False, "not applied (torch was loaded first; MKL has chosen already)")
    return MklDispatch(True, "MKL runs its AVX-512 code on this AMD CPU")


def _first_processor(cpuinfo: str) -> tuple[str, set[str]]:
    """The first processor's vendor and flags in /proc/cpuinfo's text."""
    vendor, flags = "", set[str]()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return vendor, flags


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:  # not Linux
        return ""


_state: MklDispatch | None = None


def use_mkl_avx512() -> MklDispatch:
    """Apply ``decide``'s answer to this process (once; later calls return the first outcome)."""
    global _state
    if _state is not None:
        return _state
    verdict = decide(_read_cpuinfo(), os.environ, "torch" in sys.modules)
    if verdict.applied and not _load_global():
        verdict = MklDispatch(False, f"not applied ({SHIM} is not built: {native.fallback_reason(SHIM)})")
    _state = verdict
    return verdict


def status() -> MklDispatch | None:
    """What ``use_mkl_avx512`` did in this process (None: not called)."""
    return _state


def mkl_runs_avx512(cpuinfo: str | None = None) -> bool:
    """Whether MKL runs its AVX-512 code in this process: on an Intel CPU with the instructions
    (MKL picks by features there), or where ``use_mkl_avx512`` applied. The kernels choose their
    BLAS thresholds by it (``llm_core.kernels.c_kernel``)."""
    if _state is not None and _state.applied:
        return True
    if cpuinfo is None:
        cpuinfo = _read_cpuinfo()
    vendor, flags = _first_processor(cpuinfo)
    return vendor == "GenuineIntel" and all(f in flags for f in AVX512_FLAGS)


# Flags of the dot products MKL's bf16 x bf16 -> float32 product is fast with (either).
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16")


def mkl_runs_bf16_dot(cpuinfo: str | None = None) -> bool:
    """Whether MKL's bf16 product runs on bf16 dot-product instructions here: its AVX-512 code
    (``mkl_runs_avx512``) on a CPU with AVX512-BF16 or AMX-BF16. There it ran at about twice
    sgemm's FLOPs (the decoder-layer kernel's bf16 products, ``llm_core.kernels.c_kernel``)."""
    if cpuinfo is None:
        cpuinfo = _read_cpuinfo()
    _, flags = _first_processor(cpuinfo)
    return mkl_runs_avx512(cpuinfo) and any(f in flags for f in BF16_DOT_FLAGS)


def _load_global() -> bool:
    """Load the shim with its symbols in the process's global scope (an extension module is
    otherwise loaded with local ones, which MKL would not see)."""
    flags = sys.getdlopenflags()
    sys.setdlopenflags(os.RTLD_NOW | os.RTLD_GLOBAL)
    try:
        return native.load(SHIM) is not None
    finally:
        sys.setdlopenflags(flags)
