"""use_mkl_avx512: MKL runs its AVX-512 code on AMD CPUs that have every instruction it needs, and
nowhere else; a process that applies it computes float32 products to float32 accuracy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from epd_common import mkl_dispatch
from epd_common.mkl_dispatch import MklDispatch, decide, mkl_runs_avx512, status

ROOT = Path(__file__).resolve().parents[2]
ZEN5_FLAGS = "fpu sse2 avx2 fma avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16"


def cpuinfo(vendor: str, flags: str) -> str:
    # two processors, as /proc/cpuinfo lists them: the first one's fields are read
    one = f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: {flags}\n\n"
    return one + one.replace("processor\t: 0", "processor\t: 1")


def test_applied_on_amd_with_avx512() -> None:
    got = decide(cpuinfo("AuthenticAMD", ZEN5_FLAGS), {}, torch_loaded=False)
    assert got.applied and "AVX-512" in got.reason


@pytest.mark.parametrize(
    ("vendor", "flags", "env", "torch_loaded", "why"),
    [
        ("GenuineIntel", ZEN5_FLAGS, {}, False, "GenuineIntel"),  # MKL picks by features there already
        (
            "AuthenticAMD",
            "fpu sse2 avx2 fma avx512f avx512dq avx512cd avx512vl",
            {},
            False,
            "avx512bw",
        ),  # Zen 3 class / partial
        ("AuthenticAMD", "fpu sse2 avx2 fma", {}, False, "avx512f, avx512dq, avx512bw, avx512vl"),
        ("AuthenticAMD", ZEN5_FLAGS, {"EPD_MKL_AVX512": "0"}, False, "EPD_MKL_AVX512=0"),
        ("AuthenticAMD", ZEN5_FLAGS, {}, True, "torch was loaded first"),
        ("", "", {}, False, "unknown vendor"),
    ],
)
def test_not_applied(vendor: str, flags: str, env: dict[str, str], torch_loaded: bool, why: str) -> None:
    got = decide(cpuinfo(vendor, flags) if vendor else "", env, torch_loaded)
    assert not got.applied
    assert why in got.reason


PROBE = """
import ctypes, json, os, sys
from epd_common.mkl_dispatch import use_mkl_avx512
verdict = use_mkl_avx512()
import torch
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
detect = getattr(lib, "mkl_serv_cpu_detect", None)
g = torch.Generator().manual_seed(0)
x, w = torch.randn(300, 768, generator=g), torch.randn(1280, 768, generator=g)
got = torch.nn.functional.linear(x, w).double()
ref = x.double() @ w.double().t()
print(json.dumps({
    "applied": verdict.applied, "reason": verdict.reason,
    "code_path": detect() if detect is not None else None,
    "rel_err": ((got - ref).norm() / ref.norm()).item(),
}))
"""


def probe(**env: str) -> dict[str, object]:
    """A fresh interpreter (torch not loaded yet) applying it, then one float32 product."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_fresh_process_runs_the_code_path_decide_chose() -> None:
    on, off = probe(), probe(EPD_MKL_AVX512="0")
    assert off["applied"] is False
    for run in (on, off):  # float32 accuracy either way (2.3e-7 x sqrt(768) is ~6e-6 at worst)
        assert float(run["rel_err"]) < 2e-6, run  # type: ignore[arg-type]
    if not on["applied"]:
        pytest.skip(f"not applicable on this machine: {on['reason']}")
    if on["code_path"] is None:
        pytest.skip("torch's BLAS is not MKL here")
    # MKL's own answer of which code it runs changed: AVX2's (as with it off) -> AVX-512's
    assert on["code_path"] != off["code_path"], (on, off)


def test_this_test_process_runs_what_epd_runs() -> None:
    """tests/__init__.py applies it before torch is loaded, as epd.cli does in every role."""
    got = status()
    assert got is not None
    fresh = probe()
    assert got.applied == fresh["applied"], (got, fresh)


@pytest.mark.parametrize(
    ("vendor", "flags", "applied", "expected"),
    [
        ("GenuineIntel", ZEN5_FLAGS, False, True),  # MKL picks its AVX-512 code by features there
        ("GenuineIntel", "fpu sse2 avx2 fma", False, False),
        ("AuthenticAMD", ZEN5_FLAGS, False, False),  # not applied: MKL's AVX2 code
        ("AuthenticAMD", ZEN5_FLAGS, True, True),
    ],
)
def test_mkl_runs_avx512(
    monkeypatch: pytest.MonkeyPatch, vendor: str, flags: str, applied: bool, expected: bool
) -> None:
    monkeypatch.setattr(mkl_dispatch, "_state", MklDispatch(applied, "test"))
    assert mkl_runs_avx512(cpuinfo(vendor, flags)) is expected


def test_the_kernels_send_every_expert_to_mkl_where_it_runs_avx512() -> None:
    from llm_core.kernels.c_kernel import expert_blas_min_rows

    assert expert_blas_min_rows() == (1 if mkl_runs_avx512() else 16)


@pytest.mark.parametrize(
    ("vendor", "flags", "applied", "expected"),
    [
        ("AuthenticAMD", ZEN5_FLAGS, True, True),
        ("AuthenticAMD", ZEN5_FLAGS, False, False),  # MKL's AVX2 code: no bf16 dot products in it
        ("GenuineIntel", ZEN5_FLAGS.replace(" avx512_bf16", ""), False, False),  # Skylake-server class
        ("GenuineIntel", ZEN5_FLAGS.replace("avx512_bf16", "amx_bf16"), False, True),
    ],
)
def test_mkl_runs_bf16_dot(
    monkeypatch: pytest.MonkeyPatch, vendor: str, flags: str, applied: bool, expected: bool
) -> None:
    monkeypatch.setattr(mkl_dispatch, "_state", MklDispatch(applied, "test"))
    assert mkl_dispatch.mkl_runs_bf16_dot(cpuinfo(vendor, flags)) is expected


def test_the_layer_kernel_runs_bf16_products_where_mkl_has_bf16_dot_products() -> None:
    from llm_core.kernels import cpu_layer

    if not cpu_layer.AVAILABLE:
        pytest.skip("the layer kernel is not built")
    assert cpu_layer.bf16_products() is mkl_dispatch.mkl_runs_bf16_dot()
