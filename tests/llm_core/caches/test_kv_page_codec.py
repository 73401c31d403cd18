"""Store bytes of a host page: a round trip gives the same tensors; a value that is corrupted,
truncated, under another key or of another model is refused."""

from __future__ import annotations

import json

import pytest
import torch

from llm_core.caches.host_restore import HostPage
from llm_core.caches.kv_groups import layer_spec
from llm_core.caches.kv_page_codec import PageCodecError, decode, encode
from llm_core.caches.kv_pool import KVLayout

LAYOUT = KVLayout.hybrid((None, 8, 8, None), full_kv_heads=2, window_kv_heads=1, head_dim=8, v_head_dim=4)
# two window groups (6 and 17) beside the full-attention group: their liveness is per group
TWO_WINDOWS = KVLayout.of_layers(
    [
        layer_spec(None, 2, 8, 4, 4),
        layer_spec(6, 1, 8, 4, 4),
        layer_spec(17, 3, 8, 4, 4),
        layer_spec(6, 1, 8, 4, 4),
    ]
)
PAGE = 4


def page(with_windows: bool | tuple[bool, ...], seed: int = 0, layout: KVLayout = LAYOUT) -> HostPage:
    """A host page whose window groups' KV is kept (``with_windows``: all, or per group)."""
    g = torch.Generator().manual_seed(seed)
    live = (
        with_windows
        if isinstance(with_windows, tuple)
        else (True,) + (with_windows,) * (len(layout.groups) - 1)
    )
    group_of = {i: k for k, grp in enumerate(layout.groups) for i in grp.layers}
    layers: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for i in range(layout.num_layers):
        grp = layout.groups[group_of[i]]
        if not live[group_of[i]]:
            layers.append(None)
            continue
        h = grp.spec.kv_heads
        layers.append((torch.randn(PAGE, h, 8, generator=g), torch.randn(PAGE, h, 4, generator=g)))
    nbytes = sum(k.nbytes + v.nbytes for kv in layers if kv is not None for k, v in [kv])
    return HostPage(tuple(layers), nbytes, tuple(live))


@pytest.mark.parametrize("with_windows", [True, False])
def test_round_trip(with_windows: bool) -> None:
    p = page(with_windows)
    got = decode(encode(p, 0xABC, "m1", PAGE), 0xABC, "m1", LAYOUT, PAGE, torch.float32)
    assert got.live == (True, with_windows) and got.nbytes == p.nbytes
    for a, b in zip(p.layers, got.layers, strict=True):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize(
    "live", [(True, True, True), (True, False, True), (True, True, False), (True, False, False)]
)
def test_each_window_group_is_live_on_its_own(live: tuple[bool, ...]) -> None:
    p = page(live, layout=TWO_WINDOWS)
    data = encode(p, 5, "m1", PAGE)
    got = decode(data, 5, "m1", TWO_WINDOWS, PAGE, torch.float32)
    assert got.live == live and [x is None for x in got.layers] == [x is None for x in p.layers]
    # the previous release's readers read liveness from has_swa: every layer kept, or not
    head = json.loads(bytes(data[12 : 12 + int.from_bytes(data[8:12], "little")]))
    assert head["has_swa"] is all(live)


def test_a_page_keeping_part_of_a_group_is_refused() -> None:
    p = page(True, layout=TWO_WINDOWS)
    half = HostPage(
        (p.layers[0], p.layers[1], p.layers[2], None), p.nbytes, (True, False, True)
    )  # layer 3: group 1
    with pytest.raises(PageCodecError, match="part of a KV group"):
        decode(encode(half, 5, "m1", PAGE), 5, "m1", TWO_WINDOWS, PAGE, torch.float32)


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
