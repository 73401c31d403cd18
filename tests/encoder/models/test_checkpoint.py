"""Checkpoint loading: strict checks with errors naming the problem, the embedded default, fingerprints."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from encoder.models.checkpoint import (
    DEFAULT_CONFIG,
    CheckpointError,
    default_model_dir,
    ensure_default_checkpoint,
    load_encoder,
    random_encoder,
    save_vision_checkpoint,
)
from encoder.models.config import VisionConfig

TINY = VisionConfig(
    depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=8, fullatt_block_indexes=(1,)
)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    save_vision_checkpoint(random_encoder(TINY, seed=3), path)
    return path


def rewrite(path: Path, edit: dict[str, torch.Tensor | None]) -> None:
    tensors = load_file(path / "model.safetensors")
    for name, value in edit.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    save_file(tensors, path / "model.safetensors")


def test_round_trip(ckpt: Path) -> None:
    loaded = load_encoder(ckpt)
    assert loaded.config == TINY
    ref = random_encoder(TINY, seed=3)
    x = torch.randn(16, 1176)
    with torch.inference_mode():
        assert torch.equal(loaded.model(x, torch.tensor([[1, 4, 4]])), ref(x, torch.tensor([[1, 4, 4]])))
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert (
        ref.attn_backend == "auto" and loaded.model.attn_backend == "torch"
    )  # resolved at load, for the CPU


def test_missing_config(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"missing config\.json"):
        load_encoder(ckpt)


def test_missing_weights_file(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing weights"):
        load_encoder(ckpt)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_encoder(tmp_path / "nope")


def test_wrong_model_type(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="model_type 'llama'"):
        load_encoder(ckpt)


def test_unknown_config_key_is_logged(ckpt: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["return_dict"] = True  # generic field older transformers wrote into vision_config
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level("WARNING"):
        assert load_encoder(ckpt).config == TINY
    assert "return_dict" in caplog.text


def test_bad_config_value(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["fullatt_block_indexes"] = [1, 5]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError, match=r"config\.json: bad vision config: fullatt_block_indexes \[5\]"
    ):
        load_encoder(ckpt)


def test_wrong_shape_names_tensor_and_file(ckpt: Path) -> None:
    rewrite(ckpt, {"blocks.1.mlp.up_proj.weight": torch.zeros(33, 16)})
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: tensor blocks\.1\.mlp\.up_proj\.weight has shape"
    ):
        load_encoder(ckpt)


def test_missing_tensor(ckpt: Path) -> None:
    rewrite(ckpt, {"merger.ln_q.weight": None})
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) \['merger\.ln_q\.weight'\]"):
        load_encoder(ckpt)


def test_unexpected_tensor(ckpt: Path) -> None:
    rewrite(ckpt, {"blocks.2.norm1.weight": torch.ones(16)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) \['blocks\.2\.norm1\.weight'\]"):
        load_encoder(ckpt)


def test_integer_tensor(ckpt: Path) -> None:
    rewrite(ckpt, {"merger.ln_q.weight": torch.ones(16, dtype=torch.int32)})
    with pytest.raises(CheckpointError, match="non-float dtype"):
        load_encoder(ckpt)


def test_missing_shard_file(ckpt: Path) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, ckpt / fname)
    (ckpt / "model.safetensors").unlink()
    index = {"weight_map": {n: f for f, part in shards.items() for n in part}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    good = load_encoder(ckpt)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: missing weight file"):
        load_encoder(ckpt)
    assert good.config == TINY


def _split_in_two(ckpt: Path, folder: str, with_index: bool) -> None:
    """Move the tiny tower's weights from model.safetensors into two shards under ``folder`` (""
    for the top level), listed in an index when ``with_index``."""
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    parts = {
        f"{folder}model-00001-of-00002.safetensors": names[::2],
        f"{folder}model-00002-of-00002.safetensors": names[1::2],
    }
    for fname, part in parts.items():
        (ckpt / fname).parent.mkdir(parents=True, exist_ok=True)
        save_file({n: tensors[n] for n in part}, ckpt / fname)
    (ckpt / "model.safetensors").unlink()
    if with_index:
        weight_map = {n: f for f, part in parts.items() for n in part}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize(
    ("folder", "with_index"),
    [("", True), ("vision/", True), ("", False)],
    ids=["index", "sub-folder", "no-index"],
)
def test_sharded_tower_loads_the_same_tensors(ckpt: Path, folder: str, with_index: bool) -> None:
    """The tower split across two shards (with an index, in a sub-folder, or loose) loads the same
    tensors, and so the same fingerprint, as the one-file checkpoint."""
    one_file = load_encoder(ckpt)
    _split_in_two(ckpt, folder, with_index)
    sharded = load_encoder(ckpt)
    assert sharded.fingerprint == one_file.fingerprint
    a, b = one_file.model.state_dict(), sharded.model.state_dict()  # type: ignore[attr-defined]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_index_outside_the_directory_is_refused(ckpt: Path) -> None:
    _split_in_two(ckpt, "", with_index=True)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"]["merger.ln_q.weight"] = "../elsewhere.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        CheckpointError, match=r"'merger\.ln_q\.weight' maps to '\.\./elsewhere\.safetensors'"
    ):
        load_encoder(ckpt)


def test_corrupt_safetensors(ckpt: Path) -> None:
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="unreadable safetensors"):
        load_encoder(ckpt)


def test_fingerprint_tracks_bytes(ckpt: Path) -> None:
    a = load_encoder(ckpt).fingerprint
    assert load_encoder(ckpt).fingerprint == a  # stable across loads
    assert len(a) == 64 and int(a, 16) >= 0
    tensors = load_file(ckpt / "model.safetensors")
    w = tensors["blocks.0.attn.proj.bias"].clone()
    w[0] += 1e-3
    rewrite(ckpt, {"blocks.0.attn.proj.bias": w})
    assert load_encoder(ckpt).fingerprint != a


def test_default_checkpoint_created_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_HOME", str(tmp_path / "home"))
    assert default_model_dir() == tmp_path / "home"
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_default_checkpoint())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (home,) = set(results)
    assert home.parent == tmp_path / "home" and home.name.startswith("encoder-")
    assert [p.name for p in (tmp_path / "home").iterdir()] == [home.name]  # no temp dirs left
    mtime = (home / "model.safetensors").stat().st_mtime_ns
    a = load_encoder(None)
    b = load_encoder(None)
    assert (home / "model.safetensors").stat().st_mtime_ns == mtime
    assert a.config == DEFAULT_CONFIG and a.config.out_hidden_size == 256
    assert a.fingerprint == b.fingerprint
    # The default is a real transformers checkpoint.
    assert json.loads((home / "config.json").read_text())["model_type"] == "qwen2_5_vl_vision"


def test_default_weights_deterministic() -> None:
    a = random_encoder(TINY, seed=7).state_dict()
    b = random_encoder(TINY, seed=7).state_dict()
    c = random_encoder(TINY, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])
