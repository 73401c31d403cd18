"""Block-scaled FP8 weights (llm_core/models/fp8.py): dequantization against an element-by-element
reference, partial edge blocks, and errors that name the tensor or the config field."""

from __future__ import annotations

import pytest
import torch

from llm_core.models.config import ConfigError
from llm_core.models.family import TensorFormatError
from llm_core.models.fp8 import BlockFP8, scale_name


def _fp8(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=gen) * 100).to(torch.float8_e4m3fn)


def _reference(weight: torch.Tensor, scale: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """W[r, c] = fp8[r, c] * scale[r // br, c // bc], one element at a time (in float64)."""
    w = weight.double()
    out = torch.empty_like(w)
    for r in range(w.shape[0]):
        for c in range(w.shape[1]):
            out[r, c] = w[r, c] * float(scale[r // br, c // bc])
    return out


@pytest.mark.parametrize(("rows", "cols", "br", "bc"), [(7, 10, 2, 3), (5, 4, 5, 4), (9, 3, 4, 8)])
def test_dequantize_equals_the_elementwise_definition(rows: int, cols: int, br: int, bc: int) -> None:
    fmt = BlockFP8(br, bc)
    weight = _fp8(rows, cols, seed=rows)
    sr, sc = fmt.scale_shape(rows, cols)
    assert (sr, sc) == (-(-rows // br), -(-cols // bc))
    scale = torch.rand(sr, sc, generator=torch.Generator().manual_seed(cols)) + 0.1
    got = fmt.module_weight("w.weight", weight, scale, torch.float32)
    want = _reference(weight, scale, br, bc)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    torch.testing.assert_close(got.double(), want, rtol=1e-7, atol=0)  # one fp32 product per element


def test_real_block_size_with_partial_edge_blocks() -> None:
    """A [300, 200] weight in 128x128 blocks: 3 x 2 scales, the last row and column of blocks partial."""
    fmt = BlockFP8()
    weight = _fp8(300, 200, seed=1)
    scale = torch.arange(1.0, 7.0).view(3, 2)
    got = fmt.dequantize(weight, scale)
    w = weight.float()
    assert torch.equal(got[:128, :128], w[:128, :128] * 1)
    assert torch.equal(got[:128, 128:], w[:128, 128:] * 2)
    assert torch.equal(got[256:, :128], w[256:, :128] * 5)  # 44 real rows in the last block row
    assert torch.equal(got[256:, 128:], w[256:, 128:] * 6)


def test_bf16_result_is_the_fp32_product_rounded_once() -> None:
    fmt = BlockFP8(4, 4)
    weight, scale = _fp8(8, 8, seed=3), torch.rand(2, 2) + 0.5
    assert torch.equal(
        fmt.dequantize(weight, scale, torch.bfloat16), fmt.dequantize(weight, scale).bfloat16()
    )


def test_from_quantization_config() -> None:
    fmt = BlockFP8.from_quantization_config(
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 64]}
    )
    assert (fmt.block_rows, fmt.block_cols, fmt.dtype) == (128, 64, torch.float8_e4m3fn)


@pytest.mark.parametrize(
    ("quant", "field"),
    [
        ({"quant_method": "awq", "weight_block_size": [128, 128]}, "quant_method"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt"),
        ({"quant_method": "fp8"}, "weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "weight_block_size"),
    ],
)
def test_bad_quantization_config_names_the_field(quant: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        BlockFP8.from_quantization_config(quant)


def test_errors_name_the_tensor() -> None:
    fmt = BlockFP8()
    weight = _fp8(300, 200, seed=2)
    with pytest.raises(
        TensorFormatError, match=r"'layer\.weight_scale_inv' has shape \(2, 2\).*needs \(3, 2\)"
    ):
        fmt.module_weight("layer.weight", weight, torch.ones(2, 2), torch.float32)
    with pytest.raises(TensorFormatError, match=r"'layer\.weight' is torch\.bfloat16"):
        fmt.module_weight("layer.weight", weight.bfloat16(), torch.ones(3, 2), torch.float32)
    with pytest.raises(TensorFormatError, match=r"'layer\.weight_scale_inv' has dtype torch\.int32"):
        fmt.module_weight("layer.weight", weight, torch.ones(3, 2, dtype=torch.int32), torch.float32)
    assert scale_name("a.weight") == "a.weight_scale_inv"
