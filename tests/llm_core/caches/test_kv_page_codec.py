"""Store bytes of a host page: a round trip gives the same tensors; a value that is corrupted,
truncated, under another key or of another model is refused."""

from __future__ import annotations

import pytest
import torch

from llm_core.caches.host_restore import HostPage
from llm_core.caches.kv_page_codec import PageCodecError, decode, encode
from llm_core.caches.kv_pool import KVLayout

LAYOUT = KVLayout(
    (False, True, True, False), full_kv_heads=2, swa_kv_heads=1, head_dim=8, v_head_dim=4, sliding_window=8
)
PAGE = 4


def page(with_swa: bool, seed: int = 0) -> HostPage:
    g = torch.Generator().manual_seed(seed)
    layers: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for is_swa in LAYOUT.layer_is_swa:
        if is_swa and not with_swa:
            layers.append(None)
            continue
        h = LAYOUT.swa_kv_heads if is_swa else LAYOUT.full_kv_heads
        layers.append((torch.randn(PAGE, h, 8, generator=g), torch.randn(PAGE, h, 4, generator=g)))
    nbytes = sum(k.nbytes + v.nbytes for kv in layers if kv is not None for k, v in [kv])
    return HostPage(tuple(layers), nbytes, with_swa)


@pytest.mark.parametrize("with_swa", [True, False])
def test_round_trip(with_swa: bool) -> None:
    p = page(with_swa)
    got = decode(encode(p, 0xABC, "m1", PAGE), 0xABC, "m1", LAYOUT, PAGE, torch.float32)
    assert got.has_swa == with_swa and got.nbytes == p.nbytes
    for a, b in zip(p.layers, got.layers, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_refuses_what_is_not_this_page() -> None:
    data = encode(page(True), 7, "m1", PAGE)
    flipped = bytearray(data)
    flipped[-5] ^= 0x40
    bad = {
        "corrupted": (bytes(flipped), 7, "m1", PAGE, torch.float32),
        "truncated": (data[:-16], 7, "m1", PAGE, torch.float32),
        "another key": (data, 8, "m1", PAGE, torch.float32),
        "another model": (data, 7, "m2", PAGE, torch.float32),
        "another dtype": (data, 7, "m1", PAGE, torch.bfloat16),
        "garbage": (b"\x00" * 100, 7, "m1", PAGE, torch.float32),
    }
    for why, (raw, h, model, ps, dt) in bad.items():
        with pytest.raises(PageCodecError):
            decode(raw, h, model, LAYOUT, ps, dt)
            pytest.fail(why)
