"""Whole-tree structure checks of #30 that no single package owns: what ships in the wheel, and
that each error class with a shared meaning is defined once."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("epd", "epd_common", "encoder", "llm_core", "media_io")


def _wheel_packages() -> list[str]:
    """The packages a built wheel holds: setuptools' discovery under pyproject's include list."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = cfg["tool"]["setuptools"]["packages"]["find"]["include"]
    return find_packages(where=str(ROOT), include=include)


def test_the_wheel_holds_the_product_only() -> None:
    packages = _wheel_packages()
    assert {p.split(".")[0] for p in packages} == set(PRODUCT), packages
    assert not [p for p in packages if p.split(".")[0] in ("bench", "tests")]


def _classes_named(name: str) -> list[str]:
    found = []
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            found += [
                f"{path.relative_to(ROOT)}:{node.lineno}"
                for node in ast.walk(tree)
                if isinstance(node, ast.ClassDef) and node.name == name
            ]
    return found


def test_one_checkpoint_error_class() -> None:
    assert len(_classes_named("CheckpointError")) == 1, _classes_named("CheckpointError")
