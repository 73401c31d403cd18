"""Children that stop with their parent (epd_common/child_process.py), without a Python callback
between fork and exec."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from epd_common.child_process import PARENT_ENV, die_with_parent

_RUNNING = "import time; print('running', flush=True); time.sleep(60)"


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="no setpriv")
def test_a_child_gets_sigterm_when_its_parent_is_killed() -> None:
    """parent (killed with SIGKILL, no chance to clean up) -> child under die_with_parent, once the
    child runs (setpriv arms the signal before it execs the child: a parent killed before that
    leaves nothing armed, which is why an epd child also arms itself, ``arm_from_env``)."""
    spawn = (
        "import subprocess, sys, time\n"
        "from epd_common.child_process import die_with_parent\n"
        f"p = subprocess.Popen(die_with_parent([sys.executable, '-c', {_RUNNING!r}]))\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", spawn], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    lines = {parent.stdout.readline().strip(), parent.stdout.readline().strip()}
    assert "running" in lines
    child = int((lines - {"running"}).pop())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_an_epd_child_whose_parent_is_gone_exits_at_once() -> None:
    """Without setpriv, an epd child arms itself from the environment; a parent other than the one
    named (it died and the child was re-parented) makes it exit before it does anything."""
    code = "from epd_common.child_process import arm_from_env; arm_from_env(); import time; time.sleep(60)"
    env = {**os.environ, PARENT_ENV: "1" if os.getpid() != 1 else "2"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "is gone" in done.stderr
    ok = {**os.environ, PARENT_ENV: str(os.getpid())}
    proc = subprocess.Popen([sys.executable, "-c", code.replace("60", "0.1")], env=ok)
    assert proc.wait(timeout=30) == 0


def test_the_argv_runs_under_setpriv_when_there_is_one() -> None:
    argv = die_with_parent(["x", "-y"])
    if shutil.which("setpriv"):
        assert argv[1:] == ("--pdeathsig", "TERM", "--", "x", "-y")
    else:
        assert argv == ("x", "-y")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
