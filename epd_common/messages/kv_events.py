"""What an engine's prefix cache holds, as events in vLLM's KV-event schema (plus one for SWA).

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
    {"type": "SwaTombstoned", "block_hashes": [...], "medium": "CPU", "group_idx": g}   (ours)

Groups: 0 = the full-attention pool's pages, 1 = the sliding-window pool's. A page whose SWA KV was
dropped (it fell out of the window) keeps its full KV: ``SwaTombstoned`` says so, in the same style
as ``BlockRemoved`` (a consumer that does not know it ignores an unknown tag; one that does can
apply the radix cache's hit rule: full pages [0, b) present and SWA pages of the last window live).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack

FULL_GROUP, SWA_GROUP = 0, 1
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
    # the engine always names the group: FULL_GROUP "full_attention" or SWA_GROUP "sliding_window".
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


@dataclass(frozen=True)
class SwaTombstoned:
    """The SWA KV of these pages was dropped; their full-attention KV stays cached."""

    block_hashes: tuple[int, ...]
    medium: str | None = MEDIUM
    group_idx: int | None = SWA_GROUP  # ours: SWA pages only, and always written (REQUIRED)
    REQUIRED: ClassVar[tuple[str, ...]] = ("block_hashes", "medium", "group_idx")


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared | SwaTombstoned
EVENT_TYPES: dict[str, type[Any]] = {
    cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared, SwaTombstoned)
}


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
