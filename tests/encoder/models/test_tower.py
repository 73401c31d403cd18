"""Parity of our vision tower with transformers' Qwen2_5_VisionTransformerPretrainedModel."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from encoder.models.checkpoint import ensure_default_checkpoint, load_encoder
from tests.encoder.hf_fixtures import TINY_VISION, hf_vision_model, save_hf_full_model

# Images larger than one window (4x4 patches) with ragged edge windows, and a 3-frame video.
GRIDS = [(1, 8, 12), (1, 6, 10), (3, 4, 6)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    return hf_vision_model(seed=1)


@pytest.fixture(scope="module")
def ckpt_dirs(hf_model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    dirs = {"vision": root / "vision", "full": root / "full", "sharded": root / "sharded", "v4": root / "v4"}
    hf_model.save_pretrained(dirs["vision"])
    save_hf_full_model(hf_model, dirs["full"])
    save_hf_full_model(hf_model, dirs["sharded"], max_shard_size="40KB")
    # transformers 4.5x wrote the tower under "model.visual."
    dirs["v4"].mkdir()
    tensors = load_file(dirs["full"] / "model.safetensors")
    renamed = {("model." + k if k.startswith("visual.") else k): v for k, v in tensors.items()}
    save_file(renamed, dirs["v4"] / "model.safetensors", metadata={"format": "pt"})
    (dirs["v4"] / "config.json").write_text((dirs["full"] / "config.json").read_text())
    return dirs


def make_inputs(grids: list[tuple[int, int, int]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 1176, generator=gen), torch.tensor(grids, dtype=torch.long)


def test_layouts_written_by_transformers(ckpt_dirs: dict[str, Path]) -> None:
    assert json.loads((ckpt_dirs["full"] / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    assert (ckpt_dirs["sharded"] / "model.safetensors.index.json").is_file()
    keys = load_file(ckpt_dirs["vision"] / "model.safetensors").keys()
    assert "patch_embed.proj.weight" in keys


@pytest.mark.parametrize("layout", ["vision", "full", "sharded", "v4"])
def test_parity_with_transformers(hf_model: torch.nn.Module, ckpt_dirs: dict[str, Path], layout: str) -> None:
    loaded = load_encoder(ckpt_dirs[layout])
    assert loaded.config.fullatt_block_indexes == tuple(TINY_VISION["fullatt_block_indexes"])
    assert loaded.config.window_merged == 2
    pixels, grid_thw = make_inputs(GRIDS)
    with torch.inference_mode():
        ref = hf_model(pixels, grid_thw).pooler_output
        ours = loaded.model(pixels, grid_thw)
    assert ours.shape == (pixels.shape[0] // 4, 64) == ref.shape
    assert rel_err(ours, ref) <= 1e-4


@pytest.mark.parametrize("grid", GRIDS)
def test_parity_per_item(
    hf_model: torch.nn.Module, ckpt_dirs: dict[str, Path], grid: tuple[int, int, int]
) -> None:
    loaded = load_encoder(ckpt_dirs["vision"])
    pixels, grid_thw = make_inputs([grid], seed=sum(grid))
    with torch.inference_mode():
        ref = hf_model(pixels, grid_thw).pooler_output
        ours = loaded.model(pixels, grid_thw)
    assert rel_err(ours, ref) <= 1e-4


def test_same_checkpoint_same_fingerprint_across_layouts(ckpt_dirs: dict[str, Path]) -> None:
    fps = {name: load_encoder(d).fingerprint for name, d in ckpt_dirs.items()}
    assert len(set(fps.values())) == 1, fps


def test_windows_change_the_output(ckpt_dirs: dict[str, Path]) -> None:
    """Guard that the parity inputs exercise window attention: all-full attention differs."""
    loaded = load_encoder(ckpt_dirs["vision"])
    pixels, grid_thw = make_inputs(GRIDS[:1])
    layout = loaded.model.layout([GRIDS[0]])
    assert len(layout.window.lengths) > 1
    with torch.inference_mode():
        windowed = loaded.model(pixels, grid_thw)
        full_only = loaded.model.forward_layout(pixels, layout._replace(window=layout.full))
    assert rel_err(full_only, windowed) > 1e-2


def test_batched_equals_alone(ckpt_dirs: dict[str, Path]) -> None:
    model = load_encoder(ckpt_dirs["vision"]).model
    items = [make_inputs([g], seed=i)[0] for i, g in enumerate(GRIDS)]
    with torch.inference_mode():
        alone = [model(x, torch.tensor([g])) for x, g in zip(items, GRIDS, strict=True)]
        batched = model(torch.cat(items), torch.tensor(GRIDS))
    outs = batched.split([t * h * w // 4 for t, h, w in GRIDS])
    for a, b in zip(outs, alone, strict=True):
        assert rel_err(a, b) <= 1e-5


def test_bfloat16_close_to_float32(ckpt_dirs: dict[str, Path]) -> None:
    f32 = load_encoder(ckpt_dirs["vision"])
    bf16 = load_encoder(ckpt_dirs["vision"], dtype=torch.bfloat16)
    assert bf16.fingerprint != f32.fingerprint
    pixels, grid_thw = make_inputs(GRIDS)
    with torch.inference_mode():
        a = f32.model(pixels, grid_thw)
        b = bf16.model(pixels, grid_thw)
    assert b.dtype == torch.bfloat16
    assert rel_err(b.float(), a) < 0.1


def test_bad_inputs_name_the_problem(ckpt_dirs: dict[str, Path]) -> None:
    model = load_encoder(ckpt_dirs["vision"]).model
    pixels, _ = make_inputs([(1, 4, 4)])
    with pytest.raises(ValueError, match="pixel_values has shape"):
        model(pixels, torch.tensor([[1, 4, 6]]))
    with pytest.raises(ValueError, match="grid_thw"):
        model(pixels, torch.tensor([[1, 4, 3]]))


def test_default_checkpoint_loads_in_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    monkeypatch.setenv("EPD_HOME", str(tmp_path))
    ours = load_encoder(None)
    ref = Qwen2_5_VisionTransformerPretrainedModel.from_pretrained(ensure_default_checkpoint()).eval()
    pixels, grid_thw = make_inputs([(1, 16, 12)])
    with torch.inference_mode():
        assert rel_err(ours.model(pixels, grid_thw), ref(pixels, grid_thw).pooler_output) <= 1e-4
