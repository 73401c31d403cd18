"""The bytes of a layer plan: packed from the prefill engine's pools, written into the decode engine's.

    offset 0   b"EPDKV\\x01\\0\\0"              magic and format version
           8   u32 little-endian: header length
          12   header: JSON of the plan (layout: the KV groups, page size, tokens, dtype)
     aligned   per layer in model order: K [pages, page, heads, head_dim], then V [..., v_head_dim]
               (only ``plan.pages_of(layer)``: every page of a full layer, its window's of a windowed one)

The payload carries no checksum of its own: the transport adds one over the whole buffer and
checks it before the payload is parsed. ``read`` still validates the header against the reader's
own model and every size against the buffer, so a payload from another model, dtype or page size
is refused (``PayloadError``: the decode engine recomputes) instead of being written into KV.

The layout is the list of KV groups (``KVLayout.describe``: each group's window, KV shape and
layers). The previous release wrote a two-kind map (``layer_is_swa``, one window); ``read`` still
takes it, for one release.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from llm_core.caches.kv_frame import frame_head, read_head
from llm_core.caches.kv_pool import KV_DTYPES, KVLayout, PagedKVCache, PageRows, kv_dtype_name
from llm_core.kv_transfer.layer_plan import LayerPlan

MAGIC = b"EPDKV\x01\x00\x00"


class PayloadError(ValueError):
    """The payload does not describe KV this engine can take (a recompute, not a crash)."""


def _dtype_name(dtype: torch.dtype) -> str:
    name = kv_dtype_name(dtype)
    if name is None:
        raise PayloadError(f"KV dtype {dtype} cannot be transferred")
    return name


def _blocks(plan: LayerPlan) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per layer: the K and V shapes of its block [pages, page, heads, dim]."""
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for i in range(plan.layout.num_layers):
        n, spec = len(plan.pages_of(i)), plan.group_of(i).spec
        h = spec.kv_heads
        out.append(((n, plan.page_size, h, spec.head_dim), (n, plan.page_size, h, spec.v_head_dim)))
    return out


def _layout_of(head: Any) -> KVLayout:
    """The header's layout: a list of groups, or the previous release's two-kind map."""
    if isinstance(head, list):
        return KVLayout.from_description(head)
    window = int(head["sliding_window"])
    return KVLayout.hybrid(
        [window if windowed else None for windowed in head["layer_is_swa"]],
        full_kv_heads=int(head["full_kv_heads"]),
        window_kv_heads=int(head["swa_kv_heads"]),
        head_dim=int(head["head_dim"]),
        v_head_dim=int(head["v_head_dim"]),
        dtype_bytes=int(head["dtype_bytes"]),
    )


def _shape_key(layout: KVLayout) -> tuple[tuple[object, ...], ...]:
    """What must match between the writer's and reader's layouts: each group's window, KV shape
    and layers (not the KV width, checked as the dtype, nor sinks, which keep no KV)."""
    return tuple(
        (g.spec.sliding_window, g.spec.kv_heads, g.spec.head_dim, g.spec.v_head_dim, g.layers)
        for g in layout.groups
    )


def _head(plan: LayerPlan, dtype: torch.dtype) -> bytes:
    """The frame before the body (``caches/kv_frame.py``): magic, header length, the plan as JSON."""
    body = {"layout": plan.layout.describe(), "page_size": plan.page_size, "num_tokens": plan.num_tokens}
    body["dtype"] = _dtype_name(dtype)
    return frame_head(MAGIC, body)


def pack(plan: LayerPlan, kv: PagedKVCache, rows: PageRows) -> torch.Tensor:
    """The plan's KV of one sequence (its logical-to-physical page row per KV group,
    ``KVManager.rows``) as one uint8 tensor [nbytes]."""
    dtype = kv.layer(0).k.dtype
    head = _head(plan, dtype)
    off = len(head)
    esize = torch.empty((), dtype=dtype).element_size()
    total = off + plan.nbytes
    buf = torch.empty(total, dtype=torch.uint8)
    buf[:off] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    for i, (k_shape, v_shape) in enumerate(_blocks(plan)):
        layer = kv.layer(i)
        pages = [rows[kv.layer_group[i]][j] for j in plan.pages_of(i)]
        idx = torch.tensor(kv.physical(i, pages), dtype=torch.int64)  # this layer's pages in its tensors
        for src, shape in ((layer.k, k_shape), (layer.v, v_shape)):
            nbytes = int(np.prod(shape)) * esize
            dst = buf[off : off + nbytes].view(dtype).view(shape)
            torch.index_select(src.to("cpu") if src.device.type != "cpu" else src, 0, idx, out=dst)
            off += nbytes
    assert off == total
    return buf


class Payload(NamedTuple):
    """A parsed payload: its plan and, per layer, K and V as views of the received bytes."""

    plan: LayerPlan
    blocks: list[tuple[torch.Tensor, torch.Tensor]]  # [pages, page, heads, dim] each


def read(
    data: bytes | bytearray | memoryview, layout: KVLayout, page_size: int, dtype: torch.dtype
) -> Payload:
    """Parse ``data`` for an engine of ``layout`` / ``page_size`` / KV ``dtype``; ``PayloadError``
    when it is not a payload of that model or its sizes do not add up."""
    raw = memoryview(data).cast("B")
    try:
        head, off = read_head(raw, MAGIC)
        theirs = _layout_of(head["layout"])
        plan = LayerPlan(theirs, int(head["page_size"]), int(head["num_tokens"]))
        their_dtype = KV_DTYPES[head["dtype"]]
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise PayloadError(f"not a readable KV payload: {e}") from e  # FrameError is a ValueError
    if _shape_key(theirs) != _shape_key(layout) or their_dtype != dtype or plan.page_size != page_size:
        raise PayloadError(
            f"the KV payload is for another model or format ({_shape_key(theirs)}, {head['dtype']}, "
            f"page {plan.page_size}); this engine has {_shape_key(layout)}, {_dtype_name(dtype)}, "
            f"page {page_size}"
        )
    if len(raw) != off + plan.nbytes:
        raise PayloadError(f"the KV payload has {len(raw)} bytes, its plan needs {off + plan.nbytes}")
    buf = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
    esize = torch.empty((), dtype=dtype).element_size()
    blocks = []
    for k_shape, v_shape in _blocks(plan):
        pair = []
        for shape in (k_shape, v_shape):
            nbytes = int(np.prod(shape)) * esize
            pair.append(buf[off : off + nbytes].view(dtype).view(shape))
            off += nbytes
        blocks.append((pair[0], pair[1]))
    return Payload(plan, blocks)


def write_positions(payload: Payload, kv: PagedKVCache, rows: PageRows, start: int, end: int) -> None:
    """Write the payload's KV of positions [start, end) into a sequence's pages (its page row per
    KV group, allocated for those positions), every layer in order (``write_layer_positions``)."""
    for i in range(len(payload.blocks)):
        write_layer_positions(payload, kv, i, rows, start, end)


def write_layer_positions(
    payload: Payload,
    kv: PagedKVCache,
    layer: int,
    rows: PageRows,
    start: int,
    end: int,
) -> None:
    """``write_positions`` for model layer ``layer`` only, through ``kv.layer_storage`` (a copy beside
    the forward opens ``kv.gate`` layer by layer: its writer must not wait on it). A windowed layer takes
    only the positions the payload has (from its first window page on); the rest of its pages are
    never read before they are dropped."""
    plan = payload.plan
    p = plan.page_size
    k_src, v_src = payload.blocks[layer]  # [pages_of(layer), page, heads, dim] each
    dst_layer = kv.layer_storage(layer)
    first = plan.pages_of(layer).start * p
    lo, hi = max(start, first), min(end, plan.num_tokens)
    if lo >= hi:
        return
    row = np.asarray(kv.physical(layer, rows[kv.layer_group[layer]]), dtype=np.int64)
    pos = np.arange(lo, hi, dtype=np.int64)
    slots = torch.from_numpy(row[pos // p] * p + pos % p).to(dst_layer.k.device)  # [hi - lo] flat slots
    for dst, src in ((dst_layer.k, k_src), (dst_layer.v, v_src)):
        flat = src.reshape(-1, *src.shape[2:])[lo - first : hi - first]  # [hi - lo, heads, dim]
        dst.view(-1, *dst.shape[2:]).index_copy_(0, slots, flat.to(dst.device))
