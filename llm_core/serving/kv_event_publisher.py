"""Publishes KV-event batches over ZMQ, as vLLM's engines do, with a replay for late subscribers.

    PUB     multipart (topic, sequence number: 8 bytes big-endian, msgpack batch)
    ROUTER  a subscriber that reconnected or saw a gap in the sequence numbers sends
            (b"", start sequence: 8 bytes big-endian) from a DEALER (a REQ adds the empty frame
            itself); it gets every kept batch from that number on as (b"", seq, payload), then
            (b"", -1 as 8 signed bytes, run id) to end

The run id (8 random bytes, ``run_id``) names this publisher's life: sequence numbers start at 0
again when the engine restarts, so a subscriber whose replay is answered under another run id
knows the engine restarted even when its SUB socket has not yet reconnected to see the new stream.

One thread owns both sockets (ZMQ sockets are not thread-safe); ``publish`` only queues. The last
``buffer_batches`` batches are kept for replay. A full queue drops the batch and counts it (the
engine never blocks on its observers); the gap shows as a jump in the sequence numbers, which is
what the replay is for.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque

import zmq

from epd_common.messages.kv_events import KVEventBatch, encode_batch

log = logging.getLogger("epd.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "kv-events",
        buffer_batches: int = 10_000,
        max_queue: int = 100_000,
        data_parallel_rank: int = 0,
    ) -> None:
        """``endpoint`` / ``replay_endpoint``: addresses to bind (``tcp://127.0.0.1:*`` picks a free
        port; the bound addresses are ``self.endpoint`` / ``self.replay_endpoint``)."""
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.dropped = 0
        self.run_id = os.urandom(8)  # this publisher's life (the replay's end marker carries it)
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._ready.wait(10.0)
        if self._error is not None:
            raise RuntimeError(
                f"KV event publisher could not bind {endpoint}: {self._error}"
            ) from self._error

    def publish(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch = KVEventBatch(batch.ts, batch.events, self.data_parallel_rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, then stop and close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    # -- the publisher thread ------------------------------------------------------------------
    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        replay = ctx.socket(zmq.ROUTER) if self.replay_endpoint else None
        try:
            pub.bind(self.endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if replay is not None and self.replay_endpoint:
                replay.bind(self.replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self._error = e
            pub.close(0)
            if replay is not None:
                replay.close(0)
            self._ready.set()
            return
        self._ready.set()
        seq = 0
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    break
                payload = encode_batch(batch)
                pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                seq += 1
        finally:
            time.sleep(0.05)  # let the last frames leave before the sockets close
            pub.close(linger=500)
            if replay is not None:
                replay.close(linger=500)

    def _serve_replay(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, self.run_id))
