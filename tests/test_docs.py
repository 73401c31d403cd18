"""The README and docs/ stay navigable and true to the code: the README is a short entry point that
links every page under docs/, every relative link (and #anchor) resolves, every `make` target named
exists in the Makefile, and every `--flag` named is one of the `epd` commands' flags (or, listed
below, another program's)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

README_MAX_LINES = 260

# Flags the docs name that belong to other programs: the benchmarks (`python -m bench.NAME`), vLLM,
# llama.cpp's llama-server, SGLang's bench_serving client, huggingface-cli, ruff.
FOREIGN_FLAGS = {
    # benchmarks
    "--depth", "--frame-sizes", "--minutes", "--peer", "--pipeline-bound", "--quick", "--repeats", "--rounds",
    "--sessions", "--epd-cpus", "--images", "--engines", "--policies", "--workloads", "--open-requests",
    "--tiny-qwen", "--chunks", "--vllm-bind", "--lengths", "--text-requests", "--vllm-frontend-cpus",
    "--benches",  # scripts/compare_benches.py
    "--sizes", "--concurrency",  # bench.llm_peer, bench.step_profile
    # vLLM
    "--ec-transfer-config", "--enable-mm-embeds", "--max-num-seqs", "--mm-processor-kwargs",
    "--tensor-parallel-size", "--block-size", "--enable-prompt-tokens-details", "--enable-scale-out",
    "--kv-events-config", "--prefix-caching-hash-algo", "--num-gpu-blocks-override", "--trust-remote-code",
    "--limit-mm-per-prompt", "--hf-overrides",
    # llama-server
    "--parallel", "--swa-full",
    # SGLang's bench_serving
    "--backend", "--base-url", "--max-concurrency", "--num-prompts", "--random-input-len",
    "--random-output-len",
    # huggingface-cli, ruff
    "--local-dir", "--check",
}  # fmt: skip

_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _prose(text: str) -> str:
    """``text`` without fenced code blocks (their `#` lines are comments, not headings)."""
    return _FENCE.sub("", text)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = heading.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_prose(page.read_text())):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(page: Path) -> list[str]:
    prose = _INLINE_CODE.sub("", _prose(page.read_text()))
    return [t for t in _LINK.findall(prose) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_readme_is_an_entry_point() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move depth to docs/"
    linked = {(README.parent / t.split("#")[0]).resolve() for t in _links(README) if t.split("#")[0]}
    unlinked = [p.name for p in DOCS if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_make_targets_exist() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", makefile, re.MULTILINE))
    # `make X` in prose, and command lines in code blocks that start with make
    pattern = re.compile(r"(?:`|^)make ([a-z][\w-]*)", re.MULTILINE)
    named = {t for page in PAGES for t in pattern.findall(page.read_text())}
    assert named, "no make target named in the docs: the pattern is wrong"
    assert named <= targets, f"make targets the docs name but the Makefile lacks: {sorted(named - targets)}"


def _epd_flags() -> set[str]:
    from epd.cli import SUBCOMMANDS, build_parser

    flags: set[str] = set()

    def walk(parser: argparse.ArgumentParser) -> None:
        for action in parser._actions:
            flags.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)

    for name in SUBCOMMANDS:
        if name != "bench":  # its flags are the benchmarks' (FOREIGN_FLAGS)
            walk(build_parser(only=name))
    return flags


def test_flags_exist() -> None:
    known = _epd_flags() | FOREIGN_FLAGS
    unknown = set()
    for page in PAGES:
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*\*?", page.read_text()):
            if flag.endswith("*"):  # a family of flags, e.g. `--fetch-*`
                if not any(k.startswith(flag[:-1]) for k in known):
                    unknown.add(f"{page.name}: {flag}")
            elif flag not in known:
                unknown.add(f"{page.name}: {flag}")
    assert not unknown, (
        f"flags no epd command has (a rename, or another program's: FOREIGN_FLAGS): {sorted(unknown)}"
    )
