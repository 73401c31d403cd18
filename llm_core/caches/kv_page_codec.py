"""One host page of KV as store bytes, and back, checked: what the store tier puts under a page's key.

    offset 0   b"EPDKVPG\\x01"                 magic and format version
           8   u32 little-endian: header length
          12   header: JSON {model, hash, page_size, dtype, layers, crc32, has_swa}
     aligned   per kept layer in model order: K [page, heads, head_dim], then V [page, heads, v_head_dim]

``layers`` lists which layers' KV the page carries (a window group's layers are absent when the
page was outside that window when it was spilled); each layer's shapes are its KV group's
(``kv_groups``), and a group's KV is live on the page exactly when all its layers are listed
(``HostPage.live``). ``has_swa`` (every layer kept) is written for readers of the previous
release, which read liveness from it; this release reads ``layers`` only, so pages either wrote
decode alike. ``decode`` refuses bytes for another model, page size or
dtype, bytes stored under another page's key (``hash``), sizes that do not add up, and a body whose
crc32 differs: a value truncated or corrupted in the store is a miss to recompute, never KV.
"""

from __future__ import annotations

import zlib

import torch

from llm_core.caches.host_restore import HostPage
from llm_core.caches.kv_frame import frame_head, read_head
from llm_core.caches.kv_groups import KVGroupSpec
from llm_core.caches.kv_pool import KVLayout, kv_dtype_name

MAGIC = b"EPDKVPG\x01"


class PageCodecError(ValueError):
    """Bytes that are not a page of this model's KV (a miss, not a crash)."""


def dtype_name(dtype: torch.dtype) -> str:
    name = kv_dtype_name(dtype)
    if name is None:
        raise PageCodecError(f"KV dtype {dtype} cannot be stored")
    return name


def _layer_specs(layout: KVLayout) -> list[KVGroupSpec]:
    """Each layer's KV group spec (what its K and V of one page look like)."""
    specs: list[KVGroupSpec | None] = [None] * layout.num_layers
    for g in layout.groups:
        for i in g.layers:
            specs[i] = g.spec
    assert all(s is not None for s in specs)
    return specs  # type: ignore[return-value]


def _shapes(spec: KVGroupSpec, page_size: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    return (page_size, spec.kv_heads, spec.head_dim), (page_size, spec.kv_heads, spec.v_head_dim)


def encode(page: HostPage, page_hash: int, model: str, page_size: int) -> bytes:
    """``page`` (CPU tensors) as bytes; ``model`` names the weights and KV layout it belongs to."""
    kept = [i for i, kv in enumerate(page.layers) if kv is not None]
    dtype = next(kv[0].dtype for kv in page.layers if kv is not None)
    body = b"".join(
        t.contiguous().view(torch.uint8).numpy().tobytes()
        for i in kept
        for t in page.layers[i]  # type: ignore[union-attr]
    )
    head = {
        "model": model,
        "hash": f"{page_hash:016x}",
        "page_size": page_size,
        "dtype": dtype_name(dtype),
        "layers": kept,
        "crc32": zlib.crc32(body),
        "has_swa": all(page.live),  # for the previous release's readers
    }
    return frame_head(MAGIC, head) + body


def decode(
    data: bytes, page_hash: int, model: str, layout: KVLayout, page_size: int, dtype: torch.dtype
) -> HostPage:
    """The page in ``data``, checked against what this engine expects; ``PageCodecError`` otherwise."""
    raw = memoryview(data)
    try:
        head, off = read_head(raw, MAGIC)
        kept = [int(i) for i in head["layers"]]
        theirs = (head["model"], head["hash"], int(head["page_size"]), head["dtype"])
        crc = int(head["crc32"])
    except (ValueError, KeyError, TypeError) as e:  # FrameError is a ValueError
        raise PageCodecError(f"not a readable stored KV page: {e}") from e
    mine = (model, f"{page_hash:016x}", page_size, dtype_name(dtype))
    if theirs != mine:
        raise PageCodecError(f"the stored KV page is {theirs}, this engine expects {mine}")
    n = layout.num_layers
    specs = _layer_specs(layout)
    full = [i for i in range(n) if not specs[i].is_sliding]  # full attention: every page keeps it
    if sorted(set(kept)) != kept or not set(full) <= set(kept) or (kept and kept[-1] >= n):
        raise PageCodecError(f"the stored KV page's layers {kept} do not fit a {n}-layer model")
    has = set(kept)
    live = tuple(all(i in has for i in g.layers) for g in layout.groups)
    if any(not ok and any(i in has for i in g.layers) for ok, g in zip(live, layout.groups, strict=True)):
        raise PageCodecError(f"the stored KV page keeps part of a KV group's layers ({kept})")
    esize = torch.empty((), dtype=dtype).element_size()
    sizes = [s for i in kept for s in _shapes(specs[i], page_size)]
    need = sum(a * b * c for a, b, c in sizes) * esize
    if len(raw) != off + need:
        raise PageCodecError(f"the stored KV page has {len(raw) - off} body bytes, its layers need {need}")
    body = bytearray(raw[off:])  # owned and writable: the page's tensors are views of it
    if zlib.crc32(body) != crc:
        raise PageCodecError("the stored KV page's checksum does not match (corrupted)")
    buf = torch.frombuffer(body, dtype=torch.uint8) if need else torch.empty(0, dtype=torch.uint8)
    layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n
    pos = 0
    for i in kept:
        pair = []
        for shape in _shapes(specs[i], page_size):
            nbytes = shape[0] * shape[1] * shape[2] * esize
            pair.append(buf[pos : pos + nbytes].view(dtype).view(shape))
            pos += nbytes
        layers[i] = (pair[0], pair[1])
    return HostPage(tuple(layers), need, live)
