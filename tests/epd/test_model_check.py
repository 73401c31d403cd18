"""``epd serve --model DIR`` refuses a broken directory before any role starts, naming the file,
field or tensor; a good one is summarized per role."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from epd.model_check import ModelDirError, check_model_dir
from tests.epd.conftest import REPO, serve_fails_at_start


@pytest.fixture
def good(qwen_dir: Path) -> Path:
    return qwen_dir  # read only: the broken cases edit copies


def _copy(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "ckpt"))


def _edit_config(d: Path, change: Callable[[dict], None]) -> None:
    cfg = json.loads((d / "config.json").read_text())
    change(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _drop_vision(d: Path) -> None:
    """Rewrite the weights as one file without the tower's tensors."""
    tensors = {}
    for f in sorted(d.glob("model-*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys() if not k.startswith("visual.")})  # noqa: SIM118
        f.unlink()
    (d / "model.safetensors.index.json").unlink()
    save_file(tensors, str(d / "model.safetensors"))


def test_good_directory_summary(good: Path) -> None:
    s = check_model_dir(good)
    assert s.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert s.vision.params > 0 and s.language.params > 0 and s.language.dtype == "F32"
    assert s.language.bytes == 4 * s.language.params
    assert "vision tower" in s.describe() and "language model" in s.describe()


BROKEN: dict[str, tuple[Callable[[Path], None], str]] = {
    "missing vision weights": (_drop_vision, r"no vision tower tensors .*visual\.patch_embed\.proj\.weight"),
    "tower width": (
        lambda d: _edit_config(d, lambda c: c["vision_config"].update(out_hidden_size=64)),
        r"config\.json: vision_config\.out_hidden_size=64 differs from the language model's hidden_size=128",
    ),
    "no tokenizer": (lambda d: (d / "tokenizer.json").unlink(), r"tokenizer\.json not found"),
    "template": (
        lambda d: (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }"),
        r"chat_template\.jinja",
    ),
    "architecture": (
        lambda d: _edit_config(d, lambda c: c.update(architectures=["FooForCausalLM"])),
        r"architecture FooForCausalLM is not supported; supported: MiMoV2FlashForCausalLM, "
        r"MiMoV2ForCausalLM, Qwen2_5_VLForConditionalGeneration",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_directory_is_named(good: Path, tmp_path: Path, case: str) -> None:
    d = _copy(good, tmp_path)
    breaker, message = BROKEN[case]
    breaker(d)
    with pytest.raises(ModelDirError, match=message):
        check_model_dir(d)


def test_serve_does_not_half_start(good: Path, tmp_path: Path) -> None:
    d = _copy(good, tmp_path)
    _edit_config(d, lambda c: c["vision_config"].update(out_hidden_size=64))
    stderr = serve_fails_at_start(["--model", str(d)])
    assert "epd serve: " in stderr and "out_hidden_size=64" in stderr


def test_model_and_split_flags_are_exclusive(good: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "epd.cli", "serve", "--model", str(good), "--llm-model", str(good)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "not both" in proc.stderr


def test_no_prefix_matching() -> None:
    """``--model-n`` is not an abbreviation of ``--model-name`` (a wrong flag is an error)."""
    proc = subprocess.run(
        [sys.executable, "-m", "epd.cli", "serve", "--model-n", "x"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "unrecognized arguments: --model-n" in proc.stderr
