"""The shared checkpoint reader: config.json, the shard map and reader, and the architecture
registry (which must not load either model stack to answer)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from epd_common.checkpoint.config_json import read_config_json
from epd_common.checkpoint.errors import CheckpointError, UnknownArchitecture
from epd_common.checkpoint.registry import (
    ARCHITECTURES,
    find_architecture,
    language_family,
    processor_spec,
    supported_language_models,
    tower_family,
)
from epd_common.checkpoint.shards import read_tensors, shard_map, tensor_headers

# ---- config.json ---------------------------------------------------------------------------------


def test_config_json_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"missing config\.json: .*config\.json not found"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config\.json: not a JSON object"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    assert read_config_json(tmp_path) == {"model_type": "qwen2_5_vl"}


# ---- shards --------------------------------------------------------------------------------------


def _tensors(*names: str) -> dict[str, torch.Tensor]:
    return {n: torch.full((2, 3), float(i)) for i, n in enumerate(names)}


def test_index_selects_the_files_a_role_reads(tmp_path: Path) -> None:
    save_file(_tensors("model.a", "model.b"), tmp_path / "lm.safetensors")
    (tmp_path / "tower").mkdir()
    save_file(_tensors("visual.a"), tmp_path / "tower" / "v.safetensors")
    weight_map = {"model.a": "lm.safetensors", "model.b": "lm.safetensors", "visual.a": "tower/v.safetensors"}
    weight_map["audio.a"] = "audio.safetensors"  # never written: a role that skips it never opens it
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shards = shard_map(tmp_path)
    assert shards.index == tmp_path / "model.safetensors.index.json"
    assert shards.file_list(lambda n: n.startswith("visual.")) == [tmp_path / "tower" / "v.safetensors"]
    read = read_tensors(shards, lambda n: n.startswith("model."))
    assert sorted(read.tensors) == ["model.a", "model.b"]
    assert set(read.files.values()) == {tmp_path / "lm.safetensors"}
    with pytest.raises(CheckpointError, match=r"audio\.safetensors: missing weight file \(holds audio\.a"):
        read_tensors(shards, lambda n: True)


def test_loose_shards_are_mapped_from_their_headers(tmp_path: Path) -> None:
    save_file(_tensors("a", "b"), tmp_path / "part-1.safetensors")
    save_file(_tensors("c"), tmp_path / "part-2.safetensors")
    shards = shard_map(tmp_path)
    assert shards.index is None
    assert dict(shards.files) == {
        "a": tmp_path / "part-1.safetensors",
        "b": tmp_path / "part-1.safetensors",
        "c": tmp_path / "part-2.safetensors",
    }
    assert tensor_headers(shards)["c"] == (6, "F32")
    save_file(_tensors("c"), tmp_path / "part-3.safetensors")
    with pytest.raises(CheckpointError, match=r"tensor 'c' appears more than once"):
        shard_map(tmp_path)


def test_no_weights_and_bad_indexes(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="missing weights"):
        shard_map(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        shard_map(tmp_path)
    index.write_text(json.dumps({"weight_map": {"a": "/etc/x.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"'a' maps to '/etc/x\.safetensors', outside"):
        shard_map(tmp_path)


def test_a_truncated_file_names_the_first_cut_tensor(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(_tensors("a", "b"), path)
    path.write_bytes(path.read_bytes()[:-8])  # the last 2 floats of "b"
    with pytest.raises(
        CheckpointError, match=r"truncated: tensor 'b' needs 48 data bytes, the file holds 40"
    ):
        read_tensors(shard_map(tmp_path), lambda n: True)


# ---- registry ------------------------------------------------------------------------------------


def test_importing_the_registry_loads_no_model_stack() -> None:
    code = (
        "import sys, epd_common.checkpoint.registry;"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'encoder', 'llm_core', 'media_io', 'torch'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_row_names_modules_that_exist() -> None:
    for arch in ARCHITECTURES:
        if arch.language is not None:
            assert callable(language_family({"architectures": [arch.name]}).parse_config)
        if arch.tower is not None:
            for model_type in arch.model_types:
                assert callable(tower_family({"model_type": model_type}).build_tower)


def test_lookup_rules() -> None:
    # the language model: architectures first (a named unserved one is an error), else model_type
    assert language_family({"model_type": "mimo_v2"}).__name__ == "llm_core.models.mimo_v2"
    with pytest.raises(UnknownArchitecture, match="architecture LlamaForCausalLM is not supported"):
        language_family({"architectures": ["LlamaForCausalLM"], "model_type": "qwen2_5_vl"})
    with pytest.raises(UnknownArchitecture, match="Qwen2_5_VisionTransformerPretrainedModel"):
        language_family({"architectures": ["Qwen2_5_VisionTransformerPretrainedModel"]})
    assert "Qwen2_5_VisionTransformerPretrainedModel" not in supported_language_models()
    # the tower: by model_type, whatever the architecture says
    tower = tower_family(
        {"architectures": ["Qwen2_5_VisionTransformerPretrainedModel"], "model_type": "qwen2_5_vl"}
    )
    assert tower.__name__ == "encoder.models.qwen2_5_vl"
    with pytest.raises(UnknownArchitecture, match="model_type 'mimo_v2_flash' is not supported"):
        tower_family({"architectures": ["MiMoV2FlashForCausalLM"], "model_type": "mimo_v2_flash"})
    found = find_architecture({"architectures": ["Foo", "MiMoV2ForCausalLM"]})
    assert found is not None and found.name == "MiMoV2ForCausalLM"


def test_processor_settings() -> None:
    mimo = processor_spec({"model_type": "mimo_v2"})
    assert (mimo.settings_block, mimo.video_sampling) == ("processor_config", "mimo_v2")
    for raw in ({"architectures": ["Qwen2_5_VLForConditionalGeneration"]}, {"model_type": "llama"}, {}):
        assert processor_spec(raw).settings_block is None
