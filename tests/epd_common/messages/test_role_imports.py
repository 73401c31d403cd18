"""The role boundaries the messages package exists for: the LLM engine imports nothing of the
encoder (the two meet only in ``epd_common.messages``), and the messages import no role."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def imported_modules(package: str) -> Iterator[tuple[Path, int, str]]:
    """(file, line, module) of every import under ``package``, lazy ones inside functions included."""
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield path, node.lineno, alias.name
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                yield path, node.lineno, node.module


def offending(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path, line, module in imported_modules(package)
        if module.split(".")[0] in forbidden
    ]


def test_llm_core_imports_no_encoder() -> None:
    assert offending("llm_core", ("encoder",)) == []


def test_messages_import_no_role() -> None:
    assert offending("epd_common/messages", ("encoder", "llm_core", "epd", "media_io", "bench")) == []


def test_the_check_sees_imports() -> None:
    """The walk finds the imports it is meant to refuse (a check that sees nothing passes anyway)."""
    assert any(m.startswith("epd_common.messages") for _, _, m in imported_modules("llm_core"))
    assert any(m.startswith("encoder") for _, _, m in imported_modules("epd"))
