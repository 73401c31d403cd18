"""dtype names: "auto" keeps the checkpoint's dtype; a bad name is an error naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from epd_common.runtime import check_dtype, resolve_dtype


@pytest.mark.parametrize(
    ("config", "want"),
    [
        ({"dtype": "bfloat16"}, torch.bfloat16),
        ({"torch_dtype": "float16"}, torch.float16),
        ({"text_config": {"dtype": "bfloat16"}}, torch.bfloat16),
        ({"dtype": "float8_e4m3fn"}, torch.float32),  # not a compute dtype we run
        ({}, torch.float32),
    ],
)
def test_auto_reads_the_checkpoint(tmp_path: Path, config: dict, want: torch.dtype) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert resolve_dtype("auto", tmp_path) == want


def test_explicit_and_default() -> None:
    assert resolve_dtype("float32", "/nonexistent") == torch.float32  # --dtype wins, no file read
    assert resolve_dtype("auto", None) == torch.float32  # the embedded default
    with pytest.raises(ValueError, match=r"X\.dtype must be 'auto' or one of"):
        check_dtype("X.dtype", "fp64")
