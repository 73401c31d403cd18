"""The MiMo-V2.5 vision tower against a plain float64 reference written from the documented math
(``tests.fixtures.mimo_vit_reference``: dense per-frame masks, explicit reorders; nothing shared
with the implementation).

Also: the checkpoint layout (names, prefixes, shards never opened), the config's gotchas, batched
equals alone (directly and through the batcher), and guards that the inputs exercise the bands,
the column order and the sinks.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from encoder.models.checkpoint import CheckpointError, load_encoder, random_encoder, save_vision_checkpoint
from encoder.models.mimo_vit_config import MiMoVisionConfig
from encoder.serving.batcher import EncodeBatcher
from media_io.preprocess import Patches
from tests.fixtures.mimo_vit import tiny_mimo_vision_config, tiny_mimo_vision_tensors
from tests.fixtures.mimo_vit_reference import reference_tower

# A 3-frame video and an image whose frames (10x12 units, 480 patches) are far longer than the band
# (+-8), so bands, the column order and the sinks all matter; plus small and ragged items.
GRIDS = [(1, 20, 24), (3, 20, 24), (1, 8, 6), (1, 2, 2)]


# ------------------------------------------------------------------------------------------------
# Fixtures


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def make_pixels(grids: list[tuple[int, int, int]], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), 1536, generator=gen)


def write_checkpoint(
    path: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor], prefix: str = "visual."
) -> Path:
    """The release's layout: a flat config.json with vision_config, shards named like the release's
    (model_pp0_ep0_shard*), the tower in its own shard, LLM tensors in another listed in the index."""
    path.mkdir(parents=True)
    config = {
        "architectures": ["MiMoV2ForCausalLM"],
        "model_type": "mimo_v2",
        "vision_model_type": "mimovl",
        "dtype": "bfloat16",
        "hidden_size": cfg["out_hidden_size"],
        "vision_config": cfg,
    }
    (path / "config.json").write_text(json.dumps(config))
    vision = {prefix + name.removeprefix("visual."): t for name, t in tensors.items()}
    llm = {"model.embed_tokens.weight": torch.zeros(8, 4, dtype=torch.bfloat16)}
    save_file(vision, path / "model_pp0_ep0_shard1.safetensors")
    save_file(llm, path / "model_pp0_ep0_shard0.safetensors")
    weight_map = dict.fromkeys(vision, "model_pp0_ep0_shard1.safetensors")
    weight_map |= dict.fromkeys(llm, "model_pp0_ep0_shard0.safetensors")
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


@pytest.fixture(scope="module")
def tiny() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    cfg = tiny_mimo_vision_config()
    return cfg, tiny_mimo_vision_tensors(cfg, seed=1)


@pytest.fixture(scope="module")
def ckpt(
    tiny: tuple[dict[str, Any], dict[str, torch.Tensor]], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    cfg, tensors = tiny
    return write_checkpoint(tmp_path_factory.mktemp("mimo") / "ckpt", cfg, tensors)


@pytest.fixture(scope="module")
def model(ckpt: Path) -> Any:
    return load_encoder(ckpt).model


@pytest.fixture(scope="module")
def reference(tiny: tuple[dict[str, Any], dict[str, torch.Tensor]]) -> torch.Tensor:
    cfg, tensors = tiny
    return reference_tower(make_pixels(GRIDS), GRIDS, tensors, cfg)


# ------------------------------------------------------------------------------------------------
# Parity


def test_parity_images_and_video_batched(model: Any, reference: torch.Tensor) -> None:
    with torch.inference_mode():
        ours = model(make_pixels(GRIDS), torch.tensor(GRIDS))
    assert ours.shape == reference.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, 128)
    assert rel_err(ours, reference) <= 1e-4


@pytest.mark.parametrize("index", range(len(GRIDS)))
def test_parity_alone_and_batched_equals_alone(model: Any, reference: torch.Tensor, index: int) -> None:
    pixels = make_pixels(GRIDS)
    sizes = [t * h * w for t, h, w in GRIDS]
    start = sum(sizes[:index])
    with torch.inference_mode():
        alone = model(pixels[start : start + sizes[index]], torch.tensor([GRIDS[index]]))
        batched = model(pixels, torch.tensor(GRIDS))
    rows = slice(start // 4, (start + sizes[index]) // 4)
    assert rel_err(alone, reference[rows]) <= 1e-4
    assert rel_err(batched[rows], alone) <= 1e-5


def test_guards_inputs_exercise_bands_column_order_and_sinks(
    tiny: tuple[dict[str, Any], dict[str, torch.Tensor]], reference: torch.Tensor
) -> None:
    """The parity inputs would catch a tower without bands, without the column order, without sinks."""
    cfg, tensors = tiny
    grids = GRIDS[:1]  # one 20x24 frame: 480 patches against a +-8 band
    pixels = make_pixels(GRIDS)[: sum(t * h * w for t, h, w in grids)]
    ref = reference[: pixels.shape[0] // 4]
    no_band = reference_tower(pixels, grids, tensors, {**cfg, "visual_token_window_size": 10**6})
    rows_only = reference_tower(
        pixels,
        grids,
        tensors,
        {**cfg, "vit_window_attn_types": [0 if t == 1 else t for t in cfg["vit_window_attn_types"]]},
    )
    no_sinks = reference_tower(pixels, grids, {k: v for k, v in tensors.items() if "sinks" not in k}, cfg)
    for other in (no_band, rows_only, no_sinks):
        assert rel_err(other, ref) > 1e-2


def test_band_path_equals_dense_path(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Query blocks against reachable keys (the default) vs one dense masked call per frame."""
    from encoder.kernels import band_attention as band_mod

    pixels, grid = make_pixels(GRIDS[:2]), torch.tensor(GRIDS[:2])
    with torch.inference_mode():
        banded = model(pixels, grid)
        # A query block longer than any frame: every frame's keys at once, masked densely.
        monkeypatch.setattr(band_mod, "DEFAULT_QUERY_BLOCK", 10**6)
        dense = model(pixels, grid)
    assert rel_err(banded, dense) <= 1e-5


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton needs CUDA or TRITON_INTERPRET=1",
)
def test_triton_backend_matches_torch_backend(ckpt: Path) -> None:
    """The whole tower with the Triton kernel (interpreted on CPU: a tiny batch) vs the torch path."""
    device = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    grids = [(1, 8, 6), (2, 4, 4)]  # frames of 48, 16 and 16 patches: the +-8 band cuts the first
    pixels, grid = make_pixels(grids, seed=9), torch.tensor(grids)
    torch_model = load_encoder(ckpt).model
    triton_model = load_encoder(ckpt, device=device).model
    triton_model.attn_backend = "triton"
    with torch.inference_mode():
        ref = torch_model(pixels, grid)
        out = triton_model(pixels.to(device), grid)
    assert rel_err(out.cpu(), ref) <= 1e-5


def test_bfloat16_close_to_float32(ckpt: Path) -> None:
    f32, bf16 = load_encoder(ckpt), load_encoder(ckpt, dtype=torch.bfloat16)
    assert f32.fingerprint != bf16.fingerprint
    pixels, grid = make_pixels(GRIDS[:1]), torch.tensor(GRIDS[:1])
    with torch.inference_mode():
        a, b = f32.model(pixels, grid), bf16.model(pixels, grid)
    assert b.dtype == torch.bfloat16
    assert rel_err(b, a) < 0.1


def test_batcher_serves_the_tower_unchanged(model: Any) -> None:
    """EncodeBatcher (written for Qwen) packs MiMo items too: each gets what it gets alone."""
    items = [Patches(make_pixels([g], seed=i), g) for i, g in enumerate(GRIDS)]

    async def run() -> list[torch.Tensor]:
        async with EncodeBatcher(model, patch_budget=8192, max_wait_ms=200) as b:
            return list(await asyncio.gather(*(b.encode(p) for p in items)))

    for out, p in zip(asyncio.run(run()), items, strict=True):
        with torch.inference_mode():
            alone = model(p.pixel_values, torch.tensor([p.grid_thw]))
        assert out.shape == (p.num_patches // 4, 128)
        assert rel_err(out, alone) <= 1e-5


# ------------------------------------------------------------------------------------------------
# Checkpoint layout


def test_loads_the_release_layout(ckpt: Path) -> None:
    loaded = load_encoder(ckpt)
    cfg = loaded.config
    assert isinstance(cfg, MiMoVisionConfig)
    assert (cfg.head_dim, cfg.in_channels, cfg.patch_dim, cfg.merge_unit) == (64, 3, 1536, 4)
    assert [cfg.block_mode(i).column for i in range(6)] == [False, False, False, True, True, False]
    assert [cfg.block_mode(i).band for i in range(6)] == [None, 8, 8, 8, 8, None]
    assert loaded.model.dtype == torch.float32
    assert not any(p.requires_grad for p in loaded.model.parameters())


def test_llm_shards_are_never_opened(ckpt: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for f in ckpt.iterdir():
        if f.name != "model_pp0_ep0_shard0.safetensors":  # the LLM shard: gone
            (copy / f.name).write_bytes(f.read_bytes())
    assert load_encoder(copy).fingerprint == load_encoder(ckpt).fingerprint


def test_model_visual_prefix(
    tiny: tuple[dict[str, Any], dict[str, torch.Tensor]], ckpt: Path, tmp_path: Path
) -> None:
    cfg, tensors = tiny
    other = write_checkpoint(tmp_path / "v", cfg, tensors, prefix="model.visual.")
    assert load_encoder(other).fingerprint == load_encoder(ckpt).fingerprint


def test_save_and_random_round_trip(tmp_path: Path) -> None:
    cfg = MiMoVisionConfig.from_hf_dict(tiny_mimo_vision_config())
    model = random_encoder(cfg, seed=3)
    save_vision_checkpoint(model, tmp_path / "rt")
    loaded = load_encoder(tmp_path / "rt")
    assert loaded.config == cfg
    pixels, grid = make_pixels(GRIDS[2:]), torch.tensor(GRIDS[2:])
    with torch.inference_mode():
        assert torch.equal(loaded.model(pixels, grid), model(pixels, grid))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"visual.blocks.1.attn.sinks": None}, r"missing tensor\(s\) \['visual\.blocks\.1\.attn\.sinks'\]"),
        ({"visual.blocks.0.attn.sinks": torch.zeros(4)}, r"unexpected tensor\(s\) \['visual\.blocks\.0\.attn\.sinks'\]"),
        ({"visual.merger.ln_q.bias": torch.zeros(64)}, r"unexpected tensor\(s\) \['visual\.merger\.ln_q\.bias'\]"),
        ({"visual.blocks.2.attn.qkv.weight": torch.zeros(192, 64)}, r"tensor visual\.blocks\.2\.attn\.qkv\.weight has shape \(192, 64\), expected \(512, 64\)"),
    ],
)  # fmt: skip
def test_layout_errors_name_the_tensor(
    tiny: tuple[dict[str, Any], dict[str, torch.Tensor]], tmp_path: Path, edit: dict[str, Any], message: str
) -> None:
    cfg, tensors = tiny
    changed = dict(tensors)
    for name, value in edit.items():
        if value is None:
            del changed[name]
        else:
            changed[name] = value.to(torch.bfloat16)
    with pytest.raises(CheckpointError, match=message):
        load_encoder(write_checkpoint(tmp_path / "bad", cfg, changed))


# ------------------------------------------------------------------------------------------------
# Config


def test_real_vision_config_reads_as_documented() -> None:
    real = {
        "depth": 28, "hidden_size": 1280, "intermediate_size": 4608, "num_heads": 32,
        "num_key_value_heads": 8, "num_query_groups": 4, "out_hidden_size": 4096, "patch_size": 16,
        "spatial_patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_chans": 3,
        "hidden_act": "silu", "tokens_per_second": 2, "window_size": 128, "visual_token_window_size": 64,
        "use_sink": True, "fullatt_block_indexes": [0, 9, 18, 27],
        "vit_window_attn_types": [-1, 0, 0, 0, 0, 1, 1, 1, 1, -1, 0, 0, 0, 0, 1, 1, 1, 1, -1, 0, 0, 0, 0, 1, 1, 1, 1, -1],
    }  # fmt: skip
    cfg = MiMoVisionConfig.from_hf_dict(real)
    assert cfg == MiMoVisionConfig()  # the defaults are the release's
    assert cfg.head_dim == 64 and cfg.qkv_rows == 3072 and cfg.patch_dim == 1536
    assert [i for i in range(28) if cfg.block_mode(i).sinks] == [*range(1, 9), *range(10, 18), *range(19, 27)]
    from encoder.models import mimo_v2

    shapes = mimo_v2.disk_shapes(cfg)
    assert shapes["patch_embed.proj.weight"] == (1280, 3, 2, 16, 16)
    assert shapes["blocks.0.attn.qkv.weight"] == (3072, 1280)
    assert shapes["blocks.0.attn.proj.weight"] == (1280, 2048)
    assert shapes["merger.mlp.0.weight"] == (5120, 5120) and shapes["merger.mlp.2.weight"] == (4096, 5120)
    assert "merger.ln_q.bias" not in shapes and "blocks.0.attn.sinks" not in shapes
    assert sum(math.prod(s) for s in shapes.values()) == pytest.approx(729e6, rel=0.01)  # model card: 729M


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"fullatt_block_indexes": [0, 4]}, "disagree with the -1 entries"),
        ({"vit_window_attn_types": [-1, 0, 2, 1, 1, -1]}, r"values \[2\]"),
        ({"vit_window_attn_types": [-1, 0, 1, -1]}, "4 entries for depth 6"),
        ({"num_query_groups": 4}, "num_query_groups 4"),
        ({"spatial_patch_size": 14}, "spatial_patch_size 14"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
        ({"kv_channels": 32}, "kv_channels 32"),
    ],
)
def test_bad_config_names_the_field(edit: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MiMoVisionConfig.from_hf_dict({**tiny_mimo_vision_config(), **edit})


def test_missing_type_list_is_derived() -> None:
    raw = tiny_mimo_vision_config()
    del raw["vit_window_attn_types"]
    assert MiMoVisionConfig.from_hf_dict(raw).vit_window_attn_types == (-1, 0, 0, 0, 0, -1)
    raw = tiny_mimo_vision_config()
    del raw["fullatt_block_indexes"]
    assert MiMoVisionConfig.from_hf_dict(raw).fullatt_block_indexes == (0, 5)


def test_bad_config_is_a_checkpoint_error(
    tiny: tuple[dict[str, Any], dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    cfg, tensors = tiny
    path = write_checkpoint(tmp_path / "c", {**cfg, "fullatt_block_indexes": [0]}, tensors)
    with pytest.raises(CheckpointError, match=r"config\.json: bad vision config: fullatt_block_indexes"):
        load_encoder(path)


def test_bench_encoder_forward_smoke(ckpt: Path, tmp_path: Path) -> None:
    """``bench.encoder_forward --model DIR --depth N --frame-sizes ...`` on the MiMo tower, tiny."""
    from bench import encoder_forward

    out = tmp_path / "bench.json"
    argv = [
        "--model",
        str(ckpt),
        "--depth",
        "4",
        "--frame-sizes",
        "128x64,256x128",
        "--quick",
        "--threads",
        "1",
    ]
    assert encoder_forward.main([*argv, "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["frame_patch_ratio"] == 4.0  # 8x4 -> 16x8 units
    assert set(summary["frame_ms"]) == {"frame 128x64", "frame 256x128"}
    assert summary["frame_time_ratio"] > 0 and summary["ceiling_images_per_s"] > 0
