"""Side-by-side benchmark runs of two revisions of this repository, for refactors that must not
change speed ("ratios within noise of the previous main").

    python scripts/compare_benches.py OLD_REV [NEW_REV] [--benches llm,kv_capacity,...] [--repeats 2]
        [--args-<bench> "..."] [--out build/compare.json]

Each revision is checked out into its own worktree (``git worktree add``, removed afterwards) and
its C extensions are built in place there (where no compiler runs, this checkout's are copied: the
extensions check their source hash at import and refuse a stale build).
Each bench runs as ``python -m bench.<name> --json F`` in each tree, alternating old / new for
``--repeats`` rounds so that load drift on a shared machine hits both alike; the numeric keys of
each run's ``summary`` are reported as the median per revision and new / old. Prints a Markdown
table (and writes all runs as JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BENCHES = ("llm", "kv_capacity", "pd", "kv_tiers", "mtp")


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _checkout(rev: str, where: Path) -> Path:
    """``rev`` in a detached worktree at ``where``, with its C extensions."""
    _git("worktree", "add", "--detach", str(where), rev)
    sos = [p for p in ROOT.rglob("*.so") if not {".venv", ".peers"} & set(p.parts)]
    built = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=where,
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:  # no compiler: the checkout's builds, when their sources are unchanged
        for so in sos:
            shutil.copy2(so, where / so.relative_to(ROOT))
    return where


def _run(tree: Path, bench: str, extra: list[str], out: Path, log: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", f"bench.{bench}", *extra, "--json", str(out)]
    with log.open("w") as f:
        subprocess.run(cmd, cwd=tree, env=env, check=True, stdout=f, stderr=subprocess.STDOUT)
    summary = json.loads(out.read_text()).get("summary", {})
    return {
        k: float(v) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", default="HEAD")
    ap.add_argument("--benches", default=",".join(DEFAULT_BENCHES))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="pass --quick to every bench (plumbing check)")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "compare_benches.json")
    args, rest = ap.parse_known_args()
    per_bench: dict[str, list[str]] = {}
    it = iter(rest)
    for flag in it:  # --args-<bench> "words"
        if not flag.startswith("--args-"):
            ap.error(f"unknown argument {flag}")
        per_bench[flag.removeprefix("--args-")] = next(it).split()

    work = Path(tempfile.mkdtemp(prefix="epd-compare-"))
    revs = {"old": _git("rev-parse", args.old), "new": _git("rev-parse", args.new)}
    trees: dict[str, Path] = {}
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    try:
        for side, rev in revs.items():
            trees[side] = _checkout(rev, work / side)
        for bench in args.benches.split(","):
            extra = per_bench.get(bench, []) + (["--quick"] if args.quick else [])
            runs[bench] = {"old": [], "new": []}
            for r in range(args.repeats):
                order = ("old", "new") if r % 2 == 0 else ("new", "old")
                for side in order:
                    out, log = work / f"{bench}-{side}-{r}.json", work / f"{bench}-{side}-{r}.log"
                    print(f"[{bench}] {side} round {r + 1}/{args.repeats}", flush=True)
                    runs[bench][side].append(_run(trees[side], bench, extra, out, log))
    finally:
        for tree in trees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
        shutil.rmtree(work, ignore_errors=True)

    rows = ["| bench | summary key | old (median) | new (median) | new / old |", "|---|---|---|---|---|"]
    for bench, sides in runs.items():
        keys = sorted(set().union(*[set(r) for r in sides["old"] + sides["new"]]))
        for key in keys:
            old = statistics.median(r[key] for r in sides["old"] if key in r)
            new = statistics.median(r[key] for r in sides["new"] if key in r)
            ratio = f"{new / old:.3f}" if old else "-"
            rows.append(f"| {bench} | {key} | {old:.4g} | {new:.4g} | {ratio} |")
    print("\n".join(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"revs": revs, "runs": runs, "table": rows}, indent=1))


if __name__ == "__main__":
    main()
