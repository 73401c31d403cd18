"""Structure checks on llm_core's imports: the models describe the model and never pick a kernel
(no ``llm_core.kernels.cpu_*`` import under ``llm_core/models/``; the backends choose them), and
the backends do not import the models or the serving layer (the models import the backends)."""

from __future__ import annotations

import ast
from pathlib import Path

import llm_core

ROOT = Path(llm_core.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, as dotted names (``from a import b`` gives a and a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, package
    return [
        f"{path.relative_to(ROOT.parent)}: {name}"
        for path in files
        for name in sorted(imported_modules(path))
        if name.startswith(forbidden)
    ]


def test_no_model_module_imports_a_cpu_kernel() -> None:
    assert offenders("models", ("llm_core.kernels.cpu_",)) == []


def test_the_backends_do_not_import_the_models_or_the_serving_layer() -> None:
    assert offenders("backends", ("llm_core.models", "llm_core.serving")) == []


def test_the_check_sees_a_cpu_kernel_import(tmp_path: Path) -> None:
    """The check itself: both import forms are found."""
    path = tmp_path / "m.py"
    path.write_text("from llm_core.kernels import cpu_layer\nimport llm_core.kernels.cpu_norm\n")
    assert {n for n in imported_modules(path) if n.startswith("llm_core.kernels.cpu_")} == {
        "llm_core.kernels.cpu_layer",
        "llm_core.kernels.cpu_norm",
    }
