"""The KV event publisher over real ZMQ sockets on loopback: a SUB sees (topic, sequence, batch)
in order; a DEALER that missed batches gets them from the replay ROUTER, then the end marker."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from epd_common.messages.kv_events import FULL_GROUP, BlockRemoved, BlockStored, KVEventBatch, decode_batch
from llm_core.serving.kv_event_publisher import END_SEQ, KVEventPublisher


@pytest.fixture
def publisher() -> Iterator[KVEventPublisher]:
    pub = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv", buffer_batches=3)
    yield pub
    pub.close()


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(float(i), (BlockStored((i,), None, (1, 2), 2, group_idx=FULL_GROUP),))


def test_subscriber_sees_batches_in_order(publisher: KVEventPublisher) -> None:
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(publisher.endpoint)
    try:
        # PUB drops frames until the subscription has arrived: publish until one is seen
        deadline = time.monotonic() + 5
        first = None
        while first is None and time.monotonic() < deadline:
            publisher.publish(KVEventBatch(0.0, (BlockRemoved((0,)),)))
            if sub.poll(100):
                first = sub.recv_multipart()
        assert first is not None
        start = int.from_bytes(first[1], "big")
        while sub.poll(200):  # drain the warm-up batches
            start = int.from_bytes(sub.recv_multipart()[1], "big")
        for i in range(1, 4):
            publisher.publish(batch(i))
        got = [sub.recv_multipart() for _ in range(3)]
        assert [t for t, _, _ in got] == [b"kv"] * 3
        assert [int.from_bytes(s, "big") for _, s, _ in got] == [start + 1, start + 2, start + 3]
        decoded = [decode_batch(p) for _, _, p in got]
        assert [b.events[0] for b in decoded] == [batch(i).events[0] for i in range(1, 4)]
        assert all(b.data_parallel_rank == 0 for b in decoded)
    finally:
        sub.close(0)


def test_replay_sends_what_is_kept_from_a_sequence_number(publisher: KVEventPublisher) -> None:
    for i in range(5):  # nobody listens: PUB drops them, the replay buffer keeps the last 3
        publisher.publish(batch(i))
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(publisher.replay_endpoint or "")
    try:
        time.sleep(0.2)  # the publisher thread has sent all five
        dealer.send_multipart((b"", (3).to_bytes(8, "big")))
        frames = [dealer.recv_multipart() for _ in range(3)]
        assert [int.from_bytes(f[1], "big") for f in frames[:2]] == [3, 4]
        assert decode_batch(frames[0][2]).events == batch(3).events
        assert frames[2] == [b"", END_SEQ, publisher.run_id]  # the end marker names the run
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))  # older than kept: from the oldest kept
        frames = [dealer.recv_multipart() for _ in range(4)]
        assert [int.from_bytes(f[1], "big", signed=True) for f in frames] == [2, 3, 4, -1]
        dealer.send_multipart((b"", b"bad"))  # malformed: ignored, the publisher keeps serving
        dealer.send_multipart((b"", (4).to_bytes(8, "big")))
        assert int.from_bytes(dealer.recv_multipart()[1], "big") == 4
    finally:
        dealer.close(0)


def test_a_taken_port_is_a_clear_error(publisher: KVEventPublisher) -> None:
    with pytest.raises(RuntimeError, match="could not bind"):
        KVEventPublisher(publisher.endpoint)
