#!/usr/bin/env python3
"""``make gpu-check``: every check that needs a CUDA device, in one command, with a summary.

On a machine with a CUDA device this runs, each step under its own timeout and all of them under
one budget (default 450 s, inside the 8 minutes the check is sized for):

    wheels            the carried wheels (.gpu-wheels/, made by ``make gpu-wheels`` where pip
                      works) installed into a temporary --target dir put first on PYTHONPATH;
                      then the service's imports that the machine's own Python may lack
    build-ext         our C extensions built in place with this Python (setup.py's table)
    cuda-tests        ``pytest -m gpu``: the CUDA-marked tests (DALI's aside, below)
    triton-kernels    the Triton kernel tests run for real (TRITON_INTERPRET unset) against the
                      torch paths: encoder varlen attention, LLM paged prefill and decode
    encoder-vs-hf     our vision tower on CUDA vs transformers' on CUDA (fp32 and bf16)
    llm-vs-hf         our MiMo-V2-Flash on CUDA (dense, paged through Triton, chunked, greedy
                      decode, bf16) vs transformers' MiMoV2FlashForCausalLM on CUDA
    dali-gpu          DALI's tests (GPU decode included) when nvidia.dali is importable; else
                      skipped, and the summary says the DALI GPU path was not checked
    encoder-qps       a short bench.encoder_qps run on images (`epd serve` on the GPU against
                      the baseline service, whose forward runs on the CPU)

then prints a table (step, status, seconds, key figures) and writes it as JSON with a log of every
step's output: into --out, else $OUT when set (the device tool's folder), else build/gpu-check/.
The exit status is 1 when a step failed, timed out or was not reached in the budget.

Without a CUDA device (or without torch) it says so and exits 0. ``--only STEP,...`` reruns some
steps (the two set-up steps always run). ``--plan`` prints the steps and their commands on any
machine; ``--dry-run`` runs what it can without CUDA: the wheel install and import check, the C
build (into a temporary directory, not in place), every pytest step as ``--collect-only``, and the
benchmark's imports and flags.

This file uses the standard library only: it runs under the device machine's own Python (which
holds torch, Triton and transformers, and none of our venv), chosen by ``GPU_PYTHON``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".gpu-wheels"
DEFAULT_BUDGET_S = 450.0

# import name -> distribution, for what the service and the benchmark import that the device
# machine's Python does not hold (the rest of pyproject's dependencies are there)
CARRIED_MODULES: dict[str, str] = {
    "uhashring": "uhashring",
    "starlette": "starlette",
    "uvicorn": "uvicorn",
    "python_multipart": "python-multipart",
    "av": "av",
}
# the new parity tests have steps of their own; cuda-tests takes every other gpu-marked file
ENCODER_VS_HF = "tests/encoder/models/test_tower_cuda.py"
LLM_VS_HF = "tests/llm_core/models/test_decoder_cuda.py"
TRITON_FILES = ("tests/encoder/kernels/test_triton_varlen.py", "tests/llm_core/kernels/test_attention.py")
DALI_FILES = ("tests/media_io/test_preprocess_parity.py",)
DALI_NOT_CHECKED = "DALI not installed on this machine: its GPU path was not checked"
STEP_NAMES = (
    "wheels",
    "build-ext",
    "cuda-tests",
    "triton-kernels",
    "encoder-vs-hf",
    "llm-vs-hf",
    "dali-gpu",
    "encoder-qps",
)
_GPU_MARK = re.compile(r"pytest\.mark\.gpu\b")

_PROBE = r"""
import json, platform, sys
out = {"python": sys.version.split()[0], "executable": sys.executable, "machine": platform.machine()}
try:
    import torch
except Exception as e:
    out["torch_error"] = f"{type(e).__name__}: {e}"
else:
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    try:
        out["cuda"] = bool(torch.cuda.is_available())
    except Exception as e:
        out["cuda"], out["cuda_error"] = False, f"{type(e).__name__}: {e}"
    if out["cuda"]:
        out["device_count"] = torch.cuda.device_count()
        out["device"] = torch.cuda.get_device_name(0)
        out["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        free, total = torch.cuda.mem_get_info(0)
        out["memory_gib"] = round(total / 2**30, 1)
for name in ("triton", "transformers", "numpy", "PIL", "setuptools", "pytest"):
    try:
        out[name] = __import__(name).__version__
    except Exception as e:
        out[name] = None
import importlib.util
out["dali"] = importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None
print("PROBE " + json.dumps(out))
"""

_IMPORTS = r"""
import importlib, json, sys
site = sys.argv[1]
out = {}
for name in sys.argv[2:]:
    try:
        mod = importlib.import_module(name)
    except Exception as e:
        out[name] = {"error": f"{type(e).__name__}: {e}"}
    else:
        path = getattr(mod, "__file__", "") or ""
        out[name] = {"version": getattr(mod, "__version__", "?"), "carried": bool(site) and path.startswith(site)}
print("IMPORTS " + json.dumps(out))
"""


@dataclass
class Result:
    """One step's outcome, as the table and the JSON show it."""

    step: str
    status: str  # pass | fail | timeout | skipped | not-run
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    command: str = ""


@dataclass
class Step:
    """A command run under a timeout; ``judge`` turns (exit code, output, timed out) into a Result."""

    name: str
    what: str
    cmd: list[str]
    cap_s: float
    judge: Callable[[Step, int, str, bool], Result]
    cwd: Path = ROOT
    # gpu steps: a test that skips on a CUDA machine did not check what it is there for
    require_no_skips: bool = False
    junit: Path | None = None
    skip_reason: str | None = None  # set: not run, reported as skipped (not a failure)


class Runner:
    """Runs steps under one budget, logging every step's output to one file."""

    def __init__(self, budget_s: float, log_path: Path, env: dict[str, str]) -> None:
        self.deadline = time.monotonic() + budget_s
        self.log_path = log_path
        self.env = env
        self.results: list[Result] = []

    def run(self, step: Step) -> Result:
        command = shlex.join(step.cmd)
        if step.skip_reason is not None:
            result = Result(step.name, "skipped", note=step.skip_reason, command=command)
            self._report(result)
            return result
        left = self.deadline - time.monotonic()
        if left < 10:
            result = Result(step.name, "not-run", note="the check's time budget was spent", command=command)
            self._report(result)
            return result
        timeout = min(step.cap_s, left)
        print(f"==> {step.name}: {step.what} (timeout {timeout:.0f} s)", flush=True)
        t0 = time.monotonic()
        rc, output, timed_out = run_logged(step.cmd, step.cwd, self.env, timeout, self.log_path, step.name)
        result = step.judge(step, rc, output, timed_out)
        result.seconds = round(time.monotonic() - t0, 1)
        result.command = command
        if timed_out:
            result.status = "timeout"
            result.note = f"killed after {timeout:.0f} s" + (f"; {result.note}" if result.note else "")
        if result.status in ("fail", "timeout"):
            tail = "\n".join(output.rstrip().splitlines()[-40:])
            print(f"--- last lines of {step.name} ---\n{tail}\n---", flush=True)
        self._report(result)
        return result

    def _report(self, result: Result) -> None:
        self.results.append(result)
        extra = f" ({result.note})" if result.note else ""
        print(f"<== {result.step}: {result.status} in {result.seconds:.1f} s{extra}", flush=True)


def run_logged(
    cmd: Sequence[str], cwd: Path, env: dict[str, str], timeout: float, log_path: Path, name: str
) -> tuple[int, str, bool]:
    """Run ``cmd`` in its own process group, its output appended to ``log_path`` as it comes (a
    run cut short from outside still leaves it there); on timeout the group gets SIGINT (Python
    runs its ``finally`` blocks: the benchmark stops the services it started), then SIGKILL.
    Returns (exit code, this step's output, timed out)."""
    with open(log_path, "ab") as log:
        log.write(f"\n===== {name}: {shlex.join(cmd)}\n".encode())
        log.flush()
        start = log.tell()
        proc = subprocess.Popen(
            list(cmd), cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _signal_group(proc.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=20)
        _signal_group(proc.pid, signal.SIGKILL)  # whatever is left of the group
        proc.wait()
        log.seek(0, os.SEEK_END)
        end = log.tell()
        log.write(f"\n===== {name}: exit {proc.returncode}{' (timed out)' if timed_out else ''}\n".encode())
    with open(log_path, "rb") as log:
        log.seek(start)
        output = log.read(end - start).decode(errors="replace")
    return proc.returncode, output, timed_out


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


# -- judging outputs -------------------------------------------------------------------------------


def judge_pytest(step: Step, rc: int, output: str, timed_out: bool) -> Result:
    """Counts from the JUnit XML (the summary line when there is none); failing and skipped tests
    named in the figures."""
    figures: dict[str, Any] = {}
    failed: list[str] = []
    skipped: list[str] = []
    if step.junit is not None and step.junit.is_file():
        cases = list(ET.parse(step.junit).getroot().iter("testcase"))
        for case in cases:
            test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(test_id)
            elif (skip := case.find("skipped")) is not None:
                skipped.append(f"{test_id}: {skip.get('message', '')}")
        figures = {"tests": len(cases), "passed": len(cases) - len(failed) - len(skipped)}
        figures["failed"], figures["skipped"] = len(failed), len(skipped)
    else:
        figures = _pytest_counts(output)
    if failed:
        figures["failing"] = failed[:10]
    if skipped:
        figures["skips"] = skipped[:10]
    ok = rc == 0 and not failed and figures.get("tests", figures.get("passed", 0)) > 0
    note = ""
    if rc == 5:
        note = "no tests collected"
    elif ok and step.require_no_skips and skipped:
        ok, note = False, f"{len(skipped)} test(s) skipped on a CUDA machine"
    elif not ok and not timed_out:
        note = f"pytest exit {rc}"
    return Result(step.name, "pass" if ok else "fail", figures=figures, note=note)


def _pytest_counts(output: str) -> dict[str, Any]:
    """'3 passed, 1 skipped, 2 deselected in 4.1s' -> counts (the last such line)."""
    lines = [ln for ln in output.splitlines() if re.search(r"\b(passed|failed|error|skipped)\b", ln)]
    counts: dict[str, Any] = {}
    for number, word in re.findall(
        r"(\d+) (passed|failed|errors?|skipped|deselected)", lines[-1] if lines else ""
    ):
        counts["errors" if word.startswith("error") else word] = int(number)
    return counts


def judge_collect(step: Step, rc: int, output: str, timed_out: bool) -> Result:
    """--collect-only: how many tests the step would run (N, or N/M with M - N deselected)."""
    match = re.search(r"(\d+)(?:/(\d+))? tests? collected(?: \((\d+) deselected\))?", output)
    figures: dict[str, Any] = {}
    if match:
        figures["would_run"] = int(match.group(1))
        if match.group(2):
            figures["collected"] = int(match.group(2))
    elif "no tests collected" in output or "no tests ran" in output:
        figures["would_run"] = 0
    ok = rc == 0 and figures.get("would_run", 0) > 0
    return Result(
        step.name, "pass" if ok else "fail", figures=figures, note="" if ok else f"pytest exit {rc}"
    )


def judge_exit(step: Step, rc: int, output: str, timed_out: bool) -> Result:
    return Result(step.name, "pass" if rc == 0 else "fail", note="" if rc == 0 else f"exit {rc}")


def judge_imports(step: Step, rc: int, output: str, timed_out: bool) -> Result:
    """The wheel install's import check: every carried module importable (and whether it came
    from the carried wheels or was already there)."""
    line = next((ln for ln in output.splitlines() if ln.startswith("IMPORTS ")), None)
    if rc != 0 or line is None:
        return Result(step.name, "fail", note=f"install or import check failed (exit {rc})")
    found: dict[str, dict[str, Any]] = json.loads(line[len("IMPORTS ") :])
    missing = sorted(name for name, info in found.items() if "error" in info)
    figures: dict[str, Any] = {
        name: (
            f"{info['version']}{' (carried)' if info.get('carried') else ''}"
            if "error" not in info
            else "MISSING"
        )
        for name, info in found.items()
    }
    wheels = sorted(WHEELS.glob("*.whl"))
    figures["wheels"] = len(wheels)
    figures["wheels_mib"] = round(sum(w.stat().st_size for w in wheels) / 2**20, 1)
    note = f"missing: {', '.join(missing)} (run `make gpu-wheels` and carry .gpu-wheels)" if missing else ""
    return Result(step.name, "fail" if missing else "pass", figures=figures, note=note)


def judge_build(step: Step, rc: int, output: str, timed_out: bool) -> Result:
    """The C build: which extensions were built (all are optional: a missing one is reported, and
    fails the step only when none was built)."""
    line = next((ln for ln in output.splitlines() if ln.startswith("BUILT ")), None)
    if rc != 0 or line is None:
        return Result(step.name, "fail", note=f"build failed (exit {rc})")
    built: dict[str, str] = json.loads(line[len("BUILT ") :])
    ok = [name for name, state in built.items() if state == "built"]
    others = {name: state for name, state in built.items() if state != "built"}
    figures: dict[str, Any] = {"built": len(ok), "of": len(built)}
    if others:
        figures["not_built"] = others
    note = "" if not others else "not built (their pure-Python paths run): " + ", ".join(others)
    return Result(step.name, "pass" if ok else "fail", figures=figures, note=note)


def judge_qps(json_path: Path) -> Callable[[Step, int, str, bool], Result]:
    def judge(step: Step, rc: int, output: str, timed_out: bool) -> Result:
        figures: dict[str, Any] = {}
        if json_path.is_file():
            summary = json.loads(json_path.read_text()).get("summary", {})
            keys = ("ours_qps", "ours_p90_ms", "hot_qps", "baseline_qps", "qps_ratio", "p90_ratio", "errors")
            figures = {k: _round(summary.get(k)) for k in keys if summary.get(k) is not None}
        ok = rc == 0 and bool(figures) and figures.get("errors", 1) == 0
        note = "encoder on CUDA; the baseline's forward runs on the CPU, so qps_ratio is not the judged ratio"
        if not ok and not timed_out:
            note = f"benchmark exit {rc}" + ("" if figures else ", no summary written")
        return Result(step.name, "pass" if ok else "fail", figures=figures, note=note)

    return judge


def _round(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


# -- the steps -------------------------------------------------------------------------------------


def gpu_marked_files() -> list[str]:
    """Test files holding a ``pytest.mark.gpu`` (relative to the repository root, sorted)."""
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if _GPU_MARK.search(p.read_text(errors="replace"))
    )


def pytest_step(
    name: str,
    what: str,
    python: str,
    args: Sequence[str],
    cap_s: float,
    work: Path,
    dry_run: bool,
    require_no_skips: bool = True,
) -> Step:
    junit = work / f"{name}.xml"
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    if dry_run:
        return Step(name, what, [*cmd, "--collect-only"], cap_s, judge_collect)
    cmd.append(f"--junitxml={junit}")
    return Step(name, what, cmd, cap_s, judge_pytest, require_no_skips=require_no_skips, junit=junit)


def build_steps(python: str, site: Path, work: Path, out_dir: Path, dry_run: bool, dali: bool) -> list[Step]:
    """The check's steps in the order they run (the benchmark last: it is the one that may be cut
    when the budget runs short)."""
    wheels = sorted(str(w) for w in WHEELS.glob("*.whl"))
    # pip as the device tool's README has it: no index, no deps (each wheel names one package)
    pip_flags = "-q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check --upgrade"
    install = [python, "-m", "pip", "install", *pip_flags.split(), "--target", str(site), *wheels]
    check = [python, "-c", _IMPORTS, str(site), *CARRIED_MODULES]
    wheel_cmd = ["bash", "-c", f"{shlex.join(install)} && {shlex.join(check)}"] if wheels else check
    build_args = ["--build-lib", str(work / "ext-build")] if dry_run else ["--inplace"]
    steps = [
        Step("wheels", "install the carried wheels, check the imports", wheel_cmd, 90, judge_imports),
        Step(
            "build-ext",
            "build our C extensions with this Python" + (" (dry run: not in place)" if dry_run else ""),
            [python, str(Path(__file__).resolve()), "--build-ext", *build_args],
            150,
            judge_build,
        ),
    ]
    gpu_files = [f for f in gpu_marked_files() if f not in (ENCODER_VS_HF, LLM_VS_HF)]
    tests: list[tuple[str, str, list[str], float]] = [
        (
            "cuda-tests",
            "pytest -m gpu (the CUDA-marked tests; DALI's in dali-gpu)",
            ["-m", "gpu", "-k", "not dali", *gpu_files],
            150,
        ),
        (
            "triton-kernels",
            "Triton kernels on the GPU against the torch paths",
            ["-m", "not gpu", *TRITON_FILES],
            150,
        ),
        ("encoder-vs-hf", "our encoder on CUDA vs transformers on CUDA", ["-m", "gpu", ENCODER_VS_HF], 120),
        ("llm-vs-hf", "our MiMo LLM on CUDA vs transformers on CUDA", ["-m", "gpu", LLM_VS_HF], 150),
        ("dali-gpu", "DALI's tests, its GPU decode included", ["-k", "dali", *DALI_FILES], 120),
    ]
    steps += [pytest_step(name, what, python, args, cap, work, dry_run) for name, what, args, cap in tests]
    if not dali:
        steps[-1].skip_reason = DALI_NOT_CHECKED
    qps_json = out_dir / "encoder_qps.json"
    qps_logs = work / "qps-logs"
    qps_cmd = [python, "-m", "bench.encoder_qps", "--video-clips", "0", "--no-ceiling", "--no-open"]
    qps_cmd += ["--requests", "48", "--rounds", "2", "--warmup", "4", "--concurrency", "8"]
    qps_cmd += ["--serve-arg=--encoder-device=cuda"]  # on the GPU or not at all (no silent CPU run)
    qps_cmd += ["--json", str(qps_json), "--log-dir", str(qps_logs)]
    if dry_run:
        imports = (
            "import bench.qps_run, bench.baseline_server, epd.cli, media_io.video_probe; print('imports ok')"
        )
        steps.append(
            Step(
                "encoder-qps",
                "the benchmark's imports and flags (dry run)",
                [
                    "bash",
                    "-c",
                    f"{shlex.join([python, '-c', imports])} && {shlex.join([*qps_cmd, '--help'])} >/dev/null",
                ],
                60,
                judge_exit,
            )
        )
    else:
        steps.append(
            Step(
                "encoder-qps",
                "a short encoder QPS run on images",
                qps_cmd,
                210,
                judge_qps(qps_json),
            )
        )
    assert tuple(step.name for step in steps) == STEP_NAMES, [step.name for step in steps]
    return steps


# -- building the C extensions (run as a child: --build-ext) ---------------------------------------


def build_extensions(inplace: bool, build_lib: str | None) -> int:
    """Build setup.py's extensions with this Python, without setup.py's pyproject metadata (which
    pins the venv's Python; the device's setuptools need not read it).

    setup.py runs with ``setuptools.setup`` swapped for a recorder, so its extension table (sources,
    headers, flags, source hashes) is the one source of truth; then a bare Distribution builds it.
    Prints ``BUILT {module: state}``: in place, each module loaded through ``epd_common.native``
    (built / stale / missing); into ``build_lib``, whether its file was written."""
    import runpy

    import setuptools
    from setuptools import Distribution

    recorded: dict[str, Any] = {}
    real_setup = setuptools.setup
    setuptools.setup = lambda **kw: recorded.update(kw)  # type: ignore[assignment]
    try:
        runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    finally:
        setuptools.setup = real_setup
    extensions = recorded["ext_modules"]
    dist = Distribution({"name": "epd-extensions", "ext_modules": extensions, "script_name": "setup.py"})
    cmd = dist.get_command_obj("build_ext")
    cmd.inplace = inplace  # type: ignore[attr-defined]
    cmd.parallel = os.cpu_count() or 1  # type: ignore[attr-defined]
    if build_lib is not None:
        cmd.build_lib = build_lib  # type: ignore[attr-defined]
        cmd.build_temp = os.path.join(build_lib, "temp")  # type: ignore[attr-defined]
    dist.run_command("build_ext")
    states: dict[str, str] = {}
    if inplace:
        sys.path.insert(0, str(ROOT))
        from epd_common import native

        for ext in extensions:
            native.load(ext.name)
            states[ext.name] = native.statuses()[ext.name].state
    else:
        for ext in extensions:
            found = list(Path(build_lib or ".").glob(ext.name.replace(".", "/") + ".*.so"))
            states[ext.name] = "built" if found else "missing"
    print("BUILT " + json.dumps(states))
    return 0


# -- main ------------------------------------------------------------------------------------------


def probe(python: str) -> dict[str, Any]:
    """torch, the device and the versions, as ``python`` sees them (a child: a broken torch or
    driver cannot take this script down)."""
    try:
        done = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"torch_error": f"{python}: {e}"}
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("PROBE ")), None)
    if line is None:
        return {"torch_error": f"{python} probe failed: {(done.stderr or done.stdout).strip()[-300:]}"}
    result: dict[str, Any] = json.loads(line[len("PROBE ") :])
    return result


def child_env(site: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the kernels run for real
    paths = [str(site), str(ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_HUB_OFFLINE"] = "1"  # no network on the device machine: never wait on the hub
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["MPLBACKEND"] = "Agg"
    return env


def print_summary(info: dict[str, Any], results: list[Result], total_s: float, title: str) -> None:
    rows = [("step", "status", "s", "figures / note")]
    for r in results:
        figs = ", ".join(f"{k}={_short(v)}" for k, v in r.figures.items() if k not in ("failing", "skips"))
        text = "; ".join(x for x in (figs, r.note) if x)
        rows.append((r.step, r.status, f"{r.seconds:.1f}", text))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    print(f"\n{title}")
    device = info.get("device") or "no CUDA device"
    print(
        f"device: {device} (cc {info.get('capability', '-')}, {info.get('memory_gib', '-')} GiB) | "
        f"python {info.get('python')} | torch {info.get('torch')} (CUDA {info.get('torch_cuda')}) | "
        f"triton {info.get('triton')} | transformers {info.get('transformers')}"
    )
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)) + "  " + row[3])
    for r in results:
        for test in r.figures.get("failing", []):
            print(f"  FAILED {r.step}: {test}")
        for skip in r.figures.get("skips", []) if r.status != "pass" else []:
            print(f"  SKIPPED {r.step}: {skip}")
    if not info.get("dali"):
        print(DALI_NOT_CHECKED + " (its wheel is far over what travels to the device machine).")
    bad = [r.step for r in results if r.status in ("fail", "timeout", "not-run")]
    print(f"total {total_s:.0f} s: " + (f"FAILED ({', '.join(bad)})" if bad else "all steps passed"))


def _short(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--plan", action="store_true", help="print the steps and their commands, run nothing")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="without CUDA: install, build aside, collect the tests, no GPU runs",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="summary JSON + log (default $OUT, else build/gpu-check)"
    )
    parser.add_argument(
        "--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for all steps together"
    )
    parser.add_argument(
        "--python", default=sys.executable, help="the Python that runs the steps (default: this one)"
    )
    parser.add_argument(
        "--only",
        default=None,
        metavar="STEP,...",
        help=f"run only these steps (wheels and build-ext always run): {', '.join(STEP_NAMES[2:])}",
    )
    parser.add_argument("--build-ext", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--inplace", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--build-lib", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.build_ext:
        return build_extensions(args.inplace, args.build_lib)
    wanted = None if args.only is None else {n.strip() for n in args.only.split(",") if n.strip()}
    if wanted is not None and wanted - set(STEP_NAMES):
        unknown = ", ".join(sorted(wanted - set(STEP_NAMES)))
        parser.error(f"--only: unknown step(s) {unknown}; steps: {', '.join(STEP_NAMES)}")

    t_start = time.monotonic()
    info = probe(args.python)
    has_cuda = bool(info.get("cuda"))
    if not has_cuda and not (args.plan or args.dry_run):
        why = info.get("torch_error") or info.get("cuda_error") or "torch.cuda.is_available() is False"
        print(f"gpu-check: no CUDA device on this machine ({why}); nothing to check.")
        return 0

    out_dir: Path = args.out or (
        Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "build" / "gpu-check"
    )
    work = Path(tempfile.mkdtemp(prefix="epd-gpu-check-"))
    site = work / "site"
    steps = build_steps(args.python, site, work, out_dir, dry_run=args.dry_run, dali=bool(info.get("dali")))
    if wanted is not None:
        steps = [step for step in steps if step.name in wanted or step.name in STEP_NAMES[:2]]
    if args.plan:
        print(f"gpu-check plan (python {args.python}; budget {args.budget:.0f} s; outputs in {out_dir}):")
        for i, step in enumerate(steps, 1):
            cmd = shlex.join(step.cmd)
            if len(cmd) > 400:
                cmd = cmd[:400] + " ..."
            print(f"{i}. {step.name} (at most {step.cap_s:.0f} s): {step.what}")
            print(f"   {step.skip_reason}" if step.skip_reason else f"   $ {cmd}")
        shutil.rmtree(work, ignore_errors=True)
        return 0

    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "gpu-check.log"
    log_path.write_text(f"gpu-check {time.strftime('%Y-%m-%d %H:%M:%S')}\n{json.dumps(info)}\n")
    runner = Runner(args.budget, log_path, child_env(site))
    try:
        for step in steps:
            runner.run(step)
            write_report(out_dir, info, runner.results, time.monotonic() - t_start, args.dry_run, done=False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total_s = time.monotonic() - t_start
    title = "gpu-check DRY RUN (no GPU work was done)" if args.dry_run else "gpu-check summary"
    print_summary(info, runner.results, total_s, title)
    failed = write_report(out_dir, info, runner.results, total_s, args.dry_run, done=True)
    print(f"json: {out_dir / 'gpu-check.json'}  log: {log_path}")
    return 1 if failed else 0


def write_report(
    out_dir: Path, info: dict[str, Any], results: list[Result], seconds: float, dry_run: bool, done: bool
) -> list[str]:
    """gpu-check.json, rewritten after every step (a run cut short still leaves the steps it
    finished); returns the steps that failed."""
    failed = [r.step for r in results if r.status in ("fail", "timeout", "not-run")]
    report = {
        "dry_run": dry_run,
        "complete": done,
        "ok": done and not failed,
        "failed": failed,
        "seconds": round(seconds, 1),
        "machine": info,
        "dali": "checked" if info.get("dali") else DALI_NOT_CHECKED,
        "steps": [asdict(r) for r in results],
    }
    (out_dir / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
