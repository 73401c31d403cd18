"""Each package's ``__init__`` says what it may import, and its modules do only that (#41).

The rule is one paragraph of the package docstring, in one phrasing::

    May import: llm_core.request, epd_common; never: llm_core.serving, llm_core.models.

Its names are the project's own rooms (``epd``, ``epd_common``, ``encoder``, ``llm_core``,
``media_io`` and their packages and modules; ``bench`` and ``tests`` count as rooms no rule
names): third-party libraries are stated in prose beside it, not checked. ``none`` allows no other
room. A module of package P may import P itself and, where the longest matching name of the rule
is an allowed one, that room; a ``never`` name, or a room the rule does not name, breaks it. Every
package's rule holds for everything under it, so a subpackage only narrows its parents'. Every
import counts: lazy ones inside functions and those under ``if TYPE_CHECKING:`` too.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("epd", "epd_common", "encoder", "llm_core", "media_io")
ROOMS = (*PRODUCT, "bench", "tests")
RULE = re.compile(r"^May import: (?P<may>[^;]+?)(?:; never: (?P<never>[^;]+?))?\.?$")
NAME = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*$")

# Imports that break their package's rule and are still to be removed, each with why it stays; the
# test fails when one of them no longer occurs (then it goes from here).
PENDING: dict[tuple[str, str], str] = {}


class Rule(NamedTuple):
    package: str  # dotted, e.g. "llm_core.caches"
    may: frozenset[str]
    never: frozenset[str]

    def verdict(self, module: str) -> str | None:
        """Why importing ``module`` breaks this rule, or None when it does not."""
        if not _is_room(module) or _within(module, self.package):
            return None
        allowed = [(len(n), True) for n in self.may if _within(module, n)]
        refused = [(len(n), False) for n in self.never if _within(module, n)]
        if not allowed and not refused:
            return f"{self.package} may not import {module} (its rule does not name it)"
        if not max(allowed + refused)[1]:
            return f"{self.package} never imports {module}"
        return None


def _within(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def _is_room(module: str) -> bool:
    return module.split(".")[0] in ROOMS


def _exists(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return (path / "__init__.py").is_file() or path.with_suffix(".py").is_file()


def _names(text: str) -> frozenset[str]:
    names = frozenset(n.strip() for n in text.split(","))
    return frozenset() if names == {"none"} else names


def rule_of(init: Path) -> Rule:
    """The rule paragraph of a package's ``__init__`` docstring (exactly one)."""
    package = ".".join(init.parent.relative_to(ROOT).parts)
    doc = ast.get_docstring(ast.parse(init.read_text())) or ""
    paragraphs = [" ".join(p.split()) for p in doc.split("\n\n")]
    rules = [p for p in paragraphs if p.startswith("May import")]
    assert len(rules) == 1, f"{init.relative_to(ROOT)}: {len(rules)} 'May import:' paragraphs, not 1"
    m = RULE.match(rules[0])
    assert m, f"{init.relative_to(ROOT)}: not 'May import: a, b; never: c, d.': {rules[0]!r}"
    rule = Rule(package, _names(m["may"]), _names(m["never"] or "none"))
    for name in rule.may | rule.never:
        assert NAME.match(name) and _is_room(name), (
            f"{init.relative_to(ROOT)}: {name!r} is not one of our rooms"
        )
        assert _exists(name), f"{init.relative_to(ROOT)}: {name} names no package or module"
    return rule


def rules() -> dict[str, Rule]:
    return {
        r.package: r
        for r in (rule_of(i) for top in PRODUCT for i in sorted((ROOT / top).rglob("__init__.py")))
    }


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in ``path``; ``from a import b`` is ``a.b`` when b is a
    module of ours, and a relative import is resolved against the file's package."""
    package = path.parent.relative_to(ROOT).parts
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *filter(None, [node.module])])
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield node.lineno, sub if _is_room(sub) and _exists(sub) else base


def violations() -> list[str]:
    by_package = rules()
    found = []
    for top in PRODUCT:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.parent.relative_to(ROOT).parts
            governing = [by_package[".".join(parts[:i])] for i in range(1, len(parts) + 1)]
            rel = str(path.relative_to(ROOT))
            for line, module in sorted(set(imports(path))):
                if any(_within(module, m) and rel == f for f, m in PENDING):
                    continue
                found += [f"{rel}:{line}: {why}" for r in governing if (why := r.verdict(module))]
    return found


def test_every_package_states_its_rule() -> None:
    """Every package under the product has one rule paragraph, in the one phrasing, naming rooms
    that exist (``rule_of`` asserts each)."""
    assert set(rules()) == {
        ".".join(i.parent.relative_to(ROOT).parts)
        for top in PRODUCT
        for i in (ROOT / top).rglob("__init__.py")
    }


def test_imports_keep_their_packages_rules() -> None:
    assert violations() == []


def test_pending_exceptions_still_occur() -> None:
    """An import listed as pending that is gone leaves the list too."""
    for (rel, module), why in PENDING.items():
        assert any(_within(m, module) for _, m in imports(ROOT / rel)), (
            f"{rel} no longer imports {module}: {why}"
        )


def test_the_check_sees_what_it_refuses() -> None:
    """A check that sees nothing passes anyway: the walk finds lazy imports, TYPE_CHECKING ones and
    submodules named in ``from a import b``, and a rule refuses what it should."""
    found = list(imports(ROOT / "llm_core" / "serving" / "engine.py"))
    assert any(m == "llm_core.request" for _, m in found)
    assert any(m == "llm_core.models.checkpoint" for _, m in found)  # imported inside a method
    caches = rules()["llm_core.caches"]
    assert caches.verdict("llm_core.serving.engine") and caches.verdict("encoder.caches")
    assert caches.verdict("bench.llm") and caches.verdict("llm_core.models.config")
    assert caches.verdict("llm_core.request") is None and caches.verdict("llm_core.caches.kv_pool") is None
    assert caches.verdict("torch") is None  # third-party: prose, not checked
    models = rules()["encoder.models"]
    assert models.verdict("media_io.audio_settings") is None and models.verdict("media_io.fetch")
