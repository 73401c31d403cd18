"""Banded GQA attention with key-0 sinks: the torch path against a dense masked reference written
here, its cost (no key range beyond block + 2 * band), and the Triton kernel against the torch path
(TRITON_INTERPRET=1 on CPU, native on CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from encoder.kernels import band_attention as band_mod
from encoder.kernels.band_attention import band_attention_torch
from encoder.kernels.segments import make_segments

needs_triton_runtime = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="Triton needs CUDA or TRITON_INTERPRET=1",
)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def dense_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: list[int],
    band: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """float64, one segment at a time, a dense [L, L] mask: -inf where |i - j| > band, then the
    sink added to column 0 (after the mask), softmax, kv head h // groups for query head h."""
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        i = torch.arange(length)[:, None]
        j = torch.arange(length)[None, :]
        mask = torch.zeros(length, length, dtype=torch.float64)
        if band is not None:
            mask[(i - j).abs() > band] = float("-inf")
        for h in range(q.shape[1]):
            logits = q[rows, h] @ k[rows, h // groups].T / q.shape[-1] ** 0.5 + mask
            if sinks is not None:
                logits[:, 0] += float(sinks[h])
            out[rows, h] = torch.softmax(logits, dim=-1) @ v[rows, h // groups]
        start += length
    return out


def inputs(n: int, hq: int, hkv: int, d: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=gen)
    k = torch.randn(n, hkv, d, generator=gen)
    v = torch.randn(n, hkv, d, generator=gen)
    sinks = 2.0 * torch.randn(hq, generator=gen)
    return [t.to(DEVICE, dtype) for t in (q, k, v, sinks)]


CASES = [
    # lengths (ragged; equal lengths not back to back -> the gather path), band, query block
    ([37, 9, 37, 1], 5, 8),
    ([64, 64, 64], 3, 16),  # back to back: views
    ([40], 50, 8),  # band wider than the segment: one call
    ([23, 30], None, 8),  # no band
    ([50, 17], 1, 4),  # narrow band, tiny blocks
]


@pytest.mark.parametrize(("lengths", "band", "block"), CASES)
@pytest.mark.parametrize("with_sinks", [True, False])
def test_torch_path_matches_dense_reference(
    lengths: list[int], band: int | None, block: int, with_sinks: bool
) -> None:
    q, k, v, sinks = (t.cpu() for t in inputs(sum(lengths), 4, 2, 16, seed=len(lengths)))
    s = sinks if with_sinks else None
    out = band_attention_torch(q, k, v, make_segments(lengths), band, s, block=block)
    ref = dense_reference(q, k, v, lengths, band, s)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_sink_only_moves_queries_that_see_key_zero() -> None:
    """With band b the sink (a bias on key 0) changes exactly the first b + 1 queries of a segment."""
    lengths, band = [30, 30], 6
    q, k, v, sinks = (t.cpu() for t in inputs(60, 2, 1, 16, seed=3))
    seg = make_segments(lengths)
    with_sinks = band_attention_torch(q, k, v, seg, band, sinks, block=8)
    without = band_attention_torch(q, k, v, seg, band, None, block=8)
    changed = (with_sinks - without).abs().amax(dim=(1, 2)) > 1e-6
    expected = torch.zeros(60, dtype=torch.bool)
    expected[: band + 1] = True
    expected[30 : 30 + band + 1] = True
    assert torch.equal(changed, expected)


def test_keys_outside_the_band_do_not_matter() -> None:
    """Changing keys/values farther than the band from every query of a range leaves it bit-identical."""
    q, k, v, _ = (t.cpu() for t in inputs(96, 2, 2, 16, seed=4))
    seg = make_segments([96])
    a = band_attention_torch(q, k, v, seg, 4, None, block=16)
    k2, v2 = k.clone(), v.clone()
    k2[60:] += 3.0
    v2[60:] -= 1.0
    b = band_attention_torch(q, k2, v2, seg, 4, None, block=16)
    assert torch.equal(a[:56], b[:56])  # query 55 reaches keys up to 55 + 4 = 59
    assert not torch.equal(a[56:], b[56:])


def test_cost_is_banded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each SDPA call of a banded segment sees at most block + 2 * band keys (never the whole segment)."""
    seen: list[tuple[int, int]] = []
    real = band_mod.F.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
        seen.append((q.shape[-2], k.shape[-2]))
        return real(q, k, v, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(band_mod.F, "scaled_dot_product_attention", spy)
    q, k, v, sinks = (t.cpu() for t in inputs(1000, 2, 1, 16, seed=5))
    band_attention_torch(q, k, v, make_segments([1000]), 8, sinks, block=32)
    assert len(seen) == -(-1000 // 32)
    assert max(keys for _, keys in seen) <= 32 + 2 * 8
    assert max(queries for queries, _ in seen) <= 32


@needs_triton_runtime
@pytest.mark.parametrize(
    ("lengths", "band", "with_sinks"),
    [
        ([20, 9], 5, True),  # ragged, several query blocks, tiles skipped below and above the band
        ([20, 9], None, True),  # no band: all tiles
        ([21], 3, False),
    ],
)
def test_triton_matches_torch(lengths: list[int], band: int | None, with_sinks: bool) -> None:
    from encoder.kernels.triton_band import band_attention_triton

    q, k, v, sinks = inputs(sum(lengths), 4, 2, 16, seed=6)
    s = sinks if with_sinks else None
    seg = make_segments(lengths).to(torch.device(DEVICE))
    out = band_attention_triton(q, k, v, seg.cu_seqlens, seg.max_len, band, s, block_m=8, block_n=8)
    ref = band_attention_torch(
        q.cpu(), k.cpu(), v.cpu(), make_segments(lengths), band, None if s is None else s.cpu()
    )
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs CUDA"
)
def test_triton_bfloat16_realistic_shape() -> None:
    """Real head counts and dim (32 / 8, 64), band 64, one 1080p frame's length, bf16."""
    from encoder.kernels.triton_band import band_attention_triton

    q, k, v, sinks = inputs(8160, 32, 8, 64, seed=7, dtype=torch.bfloat16)
    seg = make_segments([8160]).to(torch.device(DEVICE))
    out = band_attention_triton(q, k, v, seg.cu_seqlens, seg.max_len, 64, sinks)
    ref = band_attention_torch(q.float(), k.float(), v.float(), seg, 64, sinks.float())
    assert float((out.float() - ref).abs().max() / ref.abs().max()) < 2e-2


def test_auto_resolves_by_device_and_head_width() -> None:
    from encoder.kernels.attention import resolve_backend

    assert resolve_backend("auto", torch.device("cpu"), 64) == "torch"
    assert resolve_backend("auto", torch.device("cuda"), 64) == "triton"
    assert resolve_backend("auto", torch.device("cuda"), 512) == "torch"  # past the Triton kernels' width
    assert resolve_backend("triton", torch.device("cpu"), 64) == "triton"  # named: as it is
