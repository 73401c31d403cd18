"""KV events on the wire (epd_common/messages/kv_events.py), read the way vLLM's consumers read them:
msgspec structs with vLLM's field list, tagged, defaults omitted, written here from the schema."""

from __future__ import annotations

import msgspec
import pytest

from epd_common.messages.kv_events import (
    FULL_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)


class VStored(msgspec.Struct, tag="BlockStored", omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[str] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class VCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True):
    pass


class VBatch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[VStored | VRemoved | VCleared]
    data_parallel_rank: int | None = None


EVENTS = (
    BlockStored(
        (11, 12), None, tuple(range(8)), 4, extra_keys=(None, ("ab" * 32,)), group_idx=FULL_GROUP,
        kv_cache_spec_kind="full_attention",
    ),
    BlockStored(
        (13,), 12, (8, 9, 10, 11), 4, group_idx=1, kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=129,
    ),
    BlockRemoved((11,), group_idx=FULL_GROUP),
    AllBlocksCleared(),
)  # fmt: skip


def test_a_vllm_consumer_reads_our_batches() -> None:
    payload = encode_batch(KVEventBatch(1.5, EVENTS, 0))
    got = msgspec.msgpack.decode(payload, type=VBatch)
    assert got.ts == 1.5 and got.data_parallel_rank == 0
    stored, swa, removed, cleared = got.events
    assert (
        isinstance(stored, VStored) and stored.block_hashes == [11, 12] and stored.token_ids == list(range(8))
    )
    assert stored.parent_block_hash is None and stored.block_size == 4 and stored.medium == "CPU"
    assert stored.extra_keys == [None, ["ab" * 32]] and stored.group_idx == 0
    assert stored.kv_cache_spec_kind == "full_attention"
    assert isinstance(swa, VStored) and swa.group_idx == 1 and swa.kv_cache_spec_sliding_window == 129
    assert isinstance(removed, VRemoved) and removed.block_hashes == [11] and removed.group_idx == 0
    assert isinstance(cleared, VCleared)


def test_we_read_vllm_batches_and_skip_unknown_types() -> None:
    theirs = VBatch(2.0, [VStored([7], 3, [1, 2], 2, None, "GPU", None), VRemoved([7], "GPU")])
    got = decode_batch(msgspec.msgpack.encode(theirs))
    assert got.events == (BlockStored((7,), 3, (1, 2), 2, medium="GPU"), BlockRemoved((7,), "GPU"))
    # a window group's KV leaving while the full KV stays is that group's BlockRemoved: vLLM's own
    # event, so a strict vLLM decoder reads every event we write
    ours = KVEventBatch(3.0, (BlockRemoved((5, 6), group_idx=2), *EVENTS))
    assert decode_batch(encode_batch(ours)) == ours
    got = msgspec.msgpack.decode(encode_batch(ours), type=VBatch)
    assert isinstance(got.events[0], VRemoved) and got.events[0].group_idx == 2


def test_the_previous_release_window_removal_reads_as_that_group_removal() -> None:
    legacy = {"ts": 1.0, "events": [
        {"type": "SwaTombstoned", "block_hashes": [5, 6], "medium": "CPU", "group_idx": 2},
        {"type": "SwaTombstoned", "block_hashes": [7], "medium": "CPU"},  # its group defaulted to 1
    ]}  # fmt: skip
    got = decode_batch(msgspec.msgpack.encode(legacy))
    assert got.events == (BlockRemoved((5, 6), group_idx=2), BlockRemoved((7,), group_idx=1))


def test_malformed_payload_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="not a KV event batch"):
        decode_batch(b"\x93\x01\x02")
