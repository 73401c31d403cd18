"""Our vision tower on CUDA against transformers' Qwen2_5_VisionTransformerPretrainedModel on CUDA.

The same tiny random checkpoint as ``test_model.py`` (written by transformers' ``save_pretrained``),
both models on the GPU: on CUDA our attention takes the Triton varlen kernel (checked by a spy),
transformers its own attention. fp32 runs with TF32 off on both sides (cuDNN allows it by default,
which would change transformers' Conv3d patch embedding), so the bar is the CPU parity bar. Marked
``gpu``: skipped on a machine without CUDA (``make gpu-check`` runs them on one).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import encoder.kernels.triton_varlen
from encoder.models.checkpoint import load_encoder
from tests.encoder.hf_fixtures import hf_vision_model
from tests.encoder.models.test_tower import GRIDS, make_inputs, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.usefixtures("no_tf32"),
]


@pytest.fixture(scope="module")
def hf_cpu() -> Any:
    return hf_vision_model(seed=1)


@pytest.fixture(scope="module")
def hf_cuda(hf_cpu: Any) -> Any:
    return copy.deepcopy(hf_cpu).to("cuda")


@pytest.fixture(scope="module")
def ckpt_dir(hf_cpu: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf_vision_cuda")
    hf_cpu.save_pretrained(path)
    return path


@pytest.fixture
def triton_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of the Triton varlen kernel (``encoder.kernels.attention`` imports it at call time)."""
    calls: list[int] = []
    real: Callable[..., torch.Tensor] = encoder.kernels.triton_varlen.varlen_attention_triton

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(encoder.kernels.triton_varlen, "varlen_attention_triton", spy)
    return calls


def test_fp32_parity_on_cuda(hf_cuda: Any, ckpt_dir: Path, triton_calls: list[int]) -> None:
    """Images and a video in one batch, window and full attention blocks, through the Triton kernel."""
    loaded = load_encoder(ckpt_dir, device="cuda")
    assert loaded.model.device.type == "cuda"
    pixels, grid_thw = make_inputs(GRIDS)
    with torch.inference_mode():
        ref = hf_cuda(pixels.cuda(), grid_thw.cuda()).pooler_output
        ours = loaded.model(pixels.cuda(), grid_thw)
    assert ours.is_cuda and ours.shape == ref.shape == (pixels.shape[0] // 4, 64)
    assert triton_calls, "the CUDA forward did not take the Triton varlen kernel"
    assert rel_err(ours.cpu(), ref.cpu()) <= 1e-4


@pytest.mark.parametrize("grid", GRIDS)
def test_fp32_parity_per_item_on_cuda(hf_cuda: Any, ckpt_dir: Path, grid: tuple[int, int, int]) -> None:
    loaded = load_encoder(ckpt_dir, device="cuda")
    pixels, grid_thw = make_inputs([grid], seed=sum(grid))
    with torch.inference_mode():
        ref = hf_cuda(pixels.cuda(), grid_thw.cuda()).pooler_output
        ours = loaded.model(pixels.cuda(), grid_thw)
    assert rel_err(ours.cpu(), ref.cpu()) <= 1e-4


def test_cuda_equals_cpu_within_fp32(hf_cpu: Any, ckpt_dir: Path) -> None:
    """Our model on CUDA (Triton) and on CPU (torch attention) compute the same function."""
    on_cpu = load_encoder(ckpt_dir).model
    on_cuda = load_encoder(ckpt_dir, device="cuda").model
    pixels, grid_thw = make_inputs(GRIDS, seed=3)
    with torch.inference_mode():
        a = on_cpu(pixels, grid_thw)
        b = on_cuda(pixels.cuda(), grid_thw).cpu()
    assert rel_err(b, a) <= 1e-4


def test_bf16_on_cuda_as_close_to_fp32_as_transformers_bf16(
    hf_cuda: Any, ckpt_dir: Path, triton_calls: list[int]
) -> None:
    """The serving dtype on the GPU: bf16 through the Triton kernel (TF32 dots). Its distance from
    transformers' fp32 output is bf16 rounding, so the bar is transformers' own bf16 distance (a
    broken kernel or mask is off by O(1), rounding by ~1e-2): at most 3x that, plus 1e-2."""
    loaded = load_encoder(ckpt_dir, dtype=torch.bfloat16, device="cuda")
    hf_bf16 = copy.deepcopy(hf_cuda).to(torch.bfloat16)
    pixels, grid_thw = make_inputs(GRIDS, seed=4)
    with torch.inference_mode():
        ref = hf_cuda(pixels.cuda(), grid_thw.cuda()).pooler_output.cpu()
        theirs = hf_bf16(pixels.cuda().bfloat16(), grid_thw.cuda()).pooler_output.float().cpu()
        ours = loaded.model(pixels.cuda(), grid_thw)
    assert ours.dtype == torch.bfloat16
    assert triton_calls
    ours_err, theirs_err = rel_err(ours.float().cpu(), ref), rel_err(theirs, ref)
    assert ours_err <= 3 * theirs_err + 1e-2, (ours_err, theirs_err)
