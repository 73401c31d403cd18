"""``epd bench`` finds the benchmarks in the source checkout, and says so clearly without one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from epd import bench_cmd
from epd.cli import main

ROOT = Path(__file__).resolve().parents[2]


def test_source_checkout_is_the_repository_root() -> None:
    assert bench_cmd.source_checkout() == ROOT


def test_installed_layout_has_no_checkout(tmp_path: Path) -> None:
    # a wheel's layout: epd in site-packages, no bench package and no pyproject.toml beside it
    site = tmp_path / "site-packages"
    (site / "epd").mkdir(parents=True)
    assert bench_cmd.source_checkout(site / "epd") is None
    # a stray bench package without the repository around it is not a checkout either
    (site / "bench").mkdir()
    (site / "bench" / "__init__.py").write_text("")
    assert bench_cmd.source_checkout(site / "epd") is None


def test_without_a_checkout_any_bench_line_gets_one_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench_cmd, "source_checkout", lambda: None)
    assert main(["bench", "encoder", "--requests", "3", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "source checkout" in err and "python -m bench." in err


def test_bench_help_finds_the_checkout_from_elsewhere(tmp_path: Path) -> None:
    """`epd` imported from outside the checkout's root (as the console script of an editable
    install, which maps only the product packages): the benchmarks still come from the checkout."""
    links = tmp_path / "links"
    links.mkdir()
    for package in ("epd", "epd_common", "encoder", "media_io", "llm_core"):
        (links / package).symlink_to(ROOT / package, target_is_directory=True)
    code = (
        "import sys\n"
        "from epd.cli import main\n"
        "try:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('BENCH_FROM', sys.modules['bench'].__file__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(links)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    ).stdout
    assert "encoder" in out
    assert f"BENCH_FROM {ROOT / 'bench' / '__init__.py'}" in out


def test_product_import_does_not_import_bench() -> None:
    code = "import sys, epd.cli, epd.bench_cmd; print(any(m.split('.')[0] == 'bench' for m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert out.strip() == "False"
