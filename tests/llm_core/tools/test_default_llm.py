"""The embedded default language model's files (llm_core/tools/default_llm.py): written once,
deterministic, under $EPD_HOME, a new directory for a changed recipe, readable by transformers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from llm_core.models.checkpoint import default_llm_config, load_llm
from llm_core.tools.default_llm import ensure_default_checkpoint


def test_default_checkpoint_is_created_once_and_deterministic(tmp_path: Path) -> None:
    a = ensure_default_checkpoint(tmp_path / "a")
    b = ensure_default_checkpoint(tmp_path / "b")
    assert a.parent == tmp_path / "a" and a.name.startswith("llm-")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_checkpoint(tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime  # not rewritten
    assert not [p for p in a.parent.iterdir() if p.name.startswith(".llm-")]  # no temp dirs left
    loaded = load_llm(a)
    assert loaded.config == default_llm_config()
    cfg = loaded.config
    assert (cfg.num_hidden_layers, cfg.sliding_window, cfg.hidden_size, cfg.vocab_size) == (8, 128, 256, 512)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok) == (8, 2)
    assert loaded.model.forward_dense(torch.arange(10)[None]).shape == (1, 10, 512)


def test_default_checkpoint_uses_epd_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_HOME", str(tmp_path))
    made = ensure_default_checkpoint()
    assert made.parent == tmp_path and load_llm(made).model_dir == made


def test_a_changed_default_never_loads_an_older_checkpoint(tmp_path: Path) -> None:
    from epd_common.settings import default_checkpoint_dir

    cfg = default_llm_config()
    here = default_checkpoint_dir(tmp_path, "llm", (cfg, 1, 1))
    assert here == default_checkpoint_dir(tmp_path, "llm", (cfg, 1, 1))  # stable
    other = dataclasses.replace(cfg, hidden_size=cfg.hidden_size * 2)
    assert len({here, default_checkpoint_dir(tmp_path, "llm", (other, 1, 1))}) == 2
    assert len({here, default_checkpoint_dir(tmp_path, "llm", (cfg, 2, 1))}) == 2
    assert len({here, default_checkpoint_dir(tmp_path, "llm", (cfg, 1, 2))}) == 2


def test_default_checkpoint_readable_by_transformers(tmp_path: Path) -> None:
    from transformers import MiMoV2FlashForCausalLM

    d = ensure_default_checkpoint(tmp_path)
    ours = load_llm(d).model
    theirs = MiMoV2FlashForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = torch.arange(0, 300, 2)[None]  # 150 tokens > window 128
    with torch.no_grad():
        ref = theirs(ids).logits
    out = ours.forward_dense(ids)
    assert float((out - ref).norm() / ref.norm()) <= 1e-4
