"""What an engine's prefix cache holds, as events in vLLM's KV-event schema.

A batch goes out as one msgpack map (events as vLLM's ``msgspec`` structs encode them:
``vllm/distributed/kv_events.py``, tagged structs, defaults omitted; vLLM's own envelope is an
array, which ``decode_batch`` reads too), so that routers built for vLLM engines (llm-d's precise
prefix scorer, Dynamo's KV router) can read ours::

    {"ts": float, "events": [event, ...], "data_parallel_rank": int}
    {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | None,
     "token_ids": [...], "block_size": n, "lora_id": None, "medium": "CPU", "lora_name": None,
     "group_idx": g, "kv_cache_spec_kind": "full_attention" | "sliding_window",
     "kv_cache_spec_sliding_window": w}            (extra_keys only when given)
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "CPU", "group_idx": g}
    {"type": "AllBlocksCleared"}

Groups are the engine's KV groups (``llm_core.caches.kv_groups``), as vLLM numbers its own: 0 is
the full-attention group, then one per window size. A page's KV is per group: ``BlockStored`` of
group g says g's KV of those pages is cached, ``BlockRemoved`` of g that it is gone. A window
group's KV may go while the full-attention KV stays (the page fell out of the window): a
``BlockRemoved`` of that group alone. A consumer applies the radix cache's hit rule
(``hit_rule``): group 0's pages [0, b) present, and each window group's pages of its last window
before b live.

The previous release wrote a window group's removal as ``{"type": "SwaTombstoned", ...,
"group_idx": g}``; ``decode_batch`` still reads it, as that group's ``BlockRemoved``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack

FULL_GROUP = 0  # the full-attention group (the others are window groups)
MEDIUM = "CPU"  # where the pages live (vLLM says "GPU" for device memory)


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]  # the stored pages' tokens, in order (media runs as their pad ids)
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None
    extra_keys: tuple[tuple[str, ...] | None, ...] | None = None  # per page: its MediaKeys
    # The optional fields default as vLLM's do (None), so "omitted" means the same on both sides;
    # the engine always names the group and its kind ("full_attention" or "sliding_window", w).
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    # fields vLLM's struct declares without a default: always on the wire, even when None
    REQUIRED: ClassVar[tuple[str, ...]] = (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    )


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = MEDIUM
    group_idx: int | None = None
    REQUIRED: ClassVar[tuple[str, ...]] = ("block_hashes", "medium")


@dataclass(frozen=True)
class AllBlocksCleared:
    REQUIRED: ClassVar[tuple[str, ...]] = ()


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES: dict[str, type[Any]] = {
    cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)
}
# The previous release's name for a window group's BlockRemoved (read for one release; its group
# defaulted to 1, the one window group of the models it served).
_LEGACY_REMOVED = "SwaTombstoned"


@dataclass(frozen=True)
class KVEventBatch:
    ts: float
    events: tuple[KVEvent, ...] = field(default_factory=tuple)
    data_parallel_rank: int | None = None


def _event_map(event: KVEvent) -> dict[str, Any]:
    out: dict[str, Any] = {"type": type(event).__name__}
    for f in fields(event):
        value = getattr(event, f.name)
        if f.name not in event.REQUIRED and value == f.default:
            continue  # omit_defaults, as msgspec does
        out[f.name] = _plain(value)
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def encode_batch(batch: KVEventBatch) -> bytes:
    body: dict[str, Any] = {"ts": batch.ts, "events": [_event_map(e) for e in batch.events]}
    if batch.data_parallel_rank is not None:
        body["data_parallel_rank"] = batch.data_parallel_rank
    return bytes(msgpack.packb(body, use_bin_type=True))


def decode_batch(payload: bytes) -> KVEventBatch:
    """The inverse of ``encode_batch``; also reads vLLM's batches, whose envelope is an array
    ``[ts, events, data_parallel_rank?]`` (its ``EventBatch`` is ``array_like``) and whose block
    hashes may be 32 bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``: read as their low 64 bits,
    the ints it sends by default). Unknown event types and fields are skipped, as a consumer of a
    newer schema should; a malformed payload raises ``ValueError``."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        if isinstance(body, list):  # vLLM's array-like envelope
            body = dict(zip(("ts", "events", "data_parallel_rank"), body, strict=False))
        events: list[KVEvent] = []
        for raw in body["events"]:
            if raw.get("type") == _LEGACY_REMOVED:
                raw = {**raw, "type": "BlockRemoved", "group_idx": raw.get("group_idx", 1)}
            cls = EVENT_TYPES.get(raw.get("type"))
            if cls is None:
                continue
            names = {f.name for f in fields(cls)}
            kw = {k: _tuple(v) for k, v in raw.items() if k in names}
            for k in ("block_hashes", "parent_block_hash"):
                if k in kw:
                    kw[k] = _hash_ints(kw[k])
            events.append(cls(**kw))
        return KVEventBatch(float(body["ts"]), tuple(events), body.get("data_parallel_rank"))
    except (KeyError, TypeError, AttributeError, ValueError, msgpack.UnpackException) as e:
        raise ValueError(f"not a KV event batch: {e}") from e


def external_hash(digest: bytes) -> int:
    """A block hash of bytes as the int vLLM publishes for it: its low 64 bits, big-endian."""
    return int.from_bytes(digest, "big") & 0xFFFF_FFFF_FFFF_FFFF


def _hash_ints(value: Any) -> Any:
    if isinstance(value, bytes):
        return external_hash(value)
    if isinstance(value, tuple):
        return tuple(_hash_ints(v) for v in value)
    return value


def _tuple(value: Any) -> Any:
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value
