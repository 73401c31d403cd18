"""FP8 block-quantized weights, as DeepSeek-V3-style checkpoints (MiMo-V2.5) store them.

A quantized linear weight W [rows, cols] is two tensors on disk::

    <name>.weight            float8_e4m3fn [rows, cols]
    <name>.weight_scale_inv  fp32 [ceil(rows / br), ceil(cols / bc)]      br x bc = weight_block_size

    W[r, c] = weight[r, c] * weight_scale_inv[r // br, c // bc]

The scale is *multiplied* in, whatever its name says (it is the inverse of the factor that
quantized the block). Edge blocks may be partial: their scale covers only the rows and columns
that exist.

``BlockFP8.module_weight`` is the one place that turns a stored (weight, scale) pair into what a
module holds: today the dequantized dense weight, computed at load on the CPU. A GPU with FP8
matmuls could keep the pair instead by changing this one function (and the module that takes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from llm_core.models.config import ConfigError
from llm_core.models.family import TensorFormatError

SCALE_SUFFIX = "_scale_inv"  # "<x>.weight" -> "<x>.weight_scale_inv"
FP8_DTYPES: dict[str, torch.dtype] = {"e4m3": torch.float8_e4m3fn}
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def scale_name(weight_name: str) -> str:
    """The scale tensor's name beside a quantized weight."""
    return weight_name + SCALE_SUFFIX


def is_fp8(t: Tensor) -> bool:
    return t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class BlockFP8:
    """Block-scaled FP8 weights: one scale per ``block_rows x block_cols`` block."""

    block_rows: int = 128
    block_cols: int = 128
    dtype: torch.dtype = torch.float8_e4m3fn  # the stored element type

    def __post_init__(self) -> None:
        if self.block_rows < 1 or self.block_cols < 1:
            raise ConfigError(
                f"weight_block_size must be positive, got [{self.block_rows}, {self.block_cols}]"
            )

    @classmethod
    def from_quantization_config(cls, quant: dict[str, Any]) -> BlockFP8:
        """From config.json's ``quantization_config`` (``quant_method`` "fp8", ``fmt`` "e4m3",
        ``weight_block_size`` [rows, cols]); ``ConfigError`` naming the field otherwise.
        ``activation_scheme`` does not matter here: the weights are dequantized, activations stay
        in the compute dtype."""
        if not isinstance(quant, dict):
            raise ConfigError(f"quantization_config must be an object, got {quant!r}")
        method = quant.get("quant_method")
        if method != "fp8":
            raise ConfigError(f"quantization_config.quant_method={method!r} is not supported (only 'fp8')")
        fmt = str(quant.get("fmt") or "e4m3")
        if fmt not in FP8_DTYPES:
            raise ConfigError(f"quantization_config.fmt={fmt!r} is not supported (only {sorted(FP8_DTYPES)})")
        block = quant.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) for b in block)):
            raise ConfigError(
                f"quantization_config.weight_block_size must be [rows, cols] (block-scaled FP8), got {block!r}"
            )
        return cls(int(block[0]), int(block[1]), FP8_DTYPES[fmt])

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """The scale grid of a [rows, cols] weight."""
        return _ceil_div(rows, self.block_rows), _ceil_div(cols, self.block_cols)

    def check(self, name: str, weight: Tensor, scale: Tensor, scale_label: str | None = None) -> None:
        """``TensorFormatError`` naming the tensor when (weight, scale) is not this format."""
        label = scale_label or scale_name(name)
        if weight.dtype != self.dtype:
            raise TensorFormatError(
                f"tensor {name!r} is {weight.dtype}, quantization_config says {self.dtype}"
            )
        if weight.dim() != 2:
            raise TensorFormatError(
                f"tensor {name!r}: block FP8 needs a 2-D weight, got shape {tuple(weight.shape)}"
            )
        if scale.dtype not in SCALE_DTYPES:
            raise TensorFormatError(f"tensor {label!r} has dtype {scale.dtype}, not a float scale")
        want = self.scale_shape(*weight.shape)
        if tuple(scale.shape) != want:
            raise TensorFormatError(
                f"tensor {label!r} has shape {tuple(scale.shape)}: {name} {tuple(weight.shape)} in "
                f"{self.block_rows}x{self.block_cols} blocks (quantization_config.weight_block_size) "
                f"needs {want}"
            )

    def dequantize(self, weight: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """weight [rows, cols] (FP8) x scale [ceil(rows/br), ceil(cols/bc)] -> [rows, cols] in ``dtype``
        (multiplied in fp32, then rounded once)."""
        rows, cols = weight.shape
        per_row = scale.float().repeat_interleave(self.block_rows, dim=0)[:rows]  # [rows, sc]
        full = per_row.repeat_interleave(self.block_cols, dim=1)[:, :cols]  # [rows, cols]
        return (weight.float() * full).to(dtype)

    def module_weight(
        self, name: str, weight: Tensor, scale: Tensor, dtype: torch.dtype, scale_label: str | None = None
    ) -> Tensor:
        """A stored (weight, scale) pair -> the module's weight (see the module docstring)."""
        self.check(name, weight, scale, scale_label)
        return self.dequantize(weight, scale, dtype)
