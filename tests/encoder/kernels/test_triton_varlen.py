"""The Triton varlen kernel against the torch path (TRITON_INTERPRET=1 on CPU, native on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from encoder.kernels.attention import varlen_attention, varlen_attention_torch
from encoder.kernels.segments import make_segments
from encoder.kernels.triton_varlen import varlen_attention_triton
from encoder.models.windows import vision_layout

needs_triton_runtime = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def qkv(
    n: int, heads: int, dim: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, heads, dim, generator=gen).to(DEVICE, dtype) for _ in range(3)]


@needs_triton_runtime
@pytest.mark.parametrize(
    ("lengths", "heads", "dim"),
    [
        ([16], 1, 16),  # one block exactly
        ([5, 23, 16, 1], 2, 16),  # ragged, a length-1 segment, lengths not multiples of the blocks
        ([40, 9], 2, 24),  # head dim padded to 32, several key blocks per segment
    ],
)
def test_matches_torch(lengths: list[int], heads: int, dim: int) -> None:
    seg = make_segments(lengths).to(torch.device(DEVICE))
    q, k, v = qkv(sum(lengths), heads, dim)
    ref = varlen_attention_torch(q, k, v, seg)
    out = varlen_attention_triton(q, k, v, seg.cu_seqlens, seg.max_len, block_m=16, block_n=16)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_triton_runtime
def test_segments_do_not_leak() -> None:
    """Changing one segment's keys/values leaves every other segment's output bit-identical."""
    seg = make_segments([8, 16, 8])
    q, k, v = qkv(32, 1, 16)
    a = varlen_attention_triton(q, k, v, seg.cu_seqlens, seg.max_len, block_m=16, block_n=16)
    k2, v2 = k.clone(), v.clone()
    k2[8:24] += 1.0
    v2[8:24] -= 2.0
    b = varlen_attention_triton(q, k2, v2, seg.cu_seqlens, seg.max_len, block_m=16, block_n=16)
    assert torch.equal(a[:8], b[:8]) and torch.equal(a[24:], b[24:])
    assert not torch.equal(a[8:24], b[8:24])


@needs_triton_runtime
def test_window_layout_and_strided_inputs() -> None:
    """Segments from a real window layout; q/k/v as strided views of one qkv tensor, as the model passes them."""
    lay = vision_layout([(1, 4, 6), (2, 2, 4)], spatial_merge_size=2, window_merged=1)
    n = lay.positions.shape[0]
    packed = torch.randn(n, 3, 2, 16).to(DEVICE)  # [N, 3, H, D]
    q, k, v = packed.unbind(1)
    assert not q.is_contiguous()
    ref = varlen_attention_torch(q, k, v, lay.window)
    out = varlen_attention_triton(q, k, v, lay.window.cu_seqlens, lay.window.max_len, block_m=16, block_n=16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    forced = varlen_attention(q, k, v, lay.window, backend="triton")  # dispatch path, default blocks
    torch.testing.assert_close(forced, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_on_gpu() -> None:
    seg = make_segments([100, 333, 64]).to(torch.device("cuda"))
    q, k, v = (t.cuda().bfloat16() for t in qkv(497, 4, 80))
    ref = varlen_attention_torch(q.float(), k.float(), v.float(), seg)
    out = varlen_attention_triton(q, k, v, seg.cu_seqlens, seg.max_len)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@needs_triton_runtime
def test_model_forward_with_triton_backend() -> None:
    from encoder.models.checkpoint import random_encoder
    from encoder.models.config import VisionConfig

    cfg = VisionConfig(
        depth=2, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=16,
        window_size=56, fullatt_block_indexes=(1,),
    )  # fmt: skip
    model = random_encoder(cfg, seed=5).to(DEVICE)
    grids = torch.tensor([[1, 8, 12], [2, 4, 4]])
    pixels = torch.randn(int(grids.prod(-1).sum()), 1176).to(DEVICE)
    with torch.inference_mode():
        ref = model(pixels, grids)
        model.attn_backend = "triton"
        out = model(pixels, grids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_model_bf16_triton_on_gpu_close_to_cpu_fp32() -> None:
    from encoder.models.checkpoint import random_encoder
    from encoder.models.config import VisionConfig

    cfg = VisionConfig(
        depth=4, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=64,
        window_size=112, fullatt_block_indexes=(1, 3),
    )  # fmt: skip
    cpu_model = random_encoder(cfg, seed=6)
    gpu_model = random_encoder(cfg, seed=6).to("cuda", torch.bfloat16)
    grids = torch.tensor([[1, 32, 44], [4, 16, 16]])
    pixels = torch.randn(int(grids.prod(-1).sum()), 1176)
    with torch.inference_mode():
        ref = cpu_model(pixels, grids)
        out = gpu_model(pixels.cuda(), grids).float().cpu()
    assert float((out - ref).abs().max() / ref.abs().max()) < 5e-2
