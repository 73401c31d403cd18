"""Follows one engine's KV-event stream (``llm_core.serving.kv_event_publisher``) without losing a batch.

    SUB     (topic, seq: 8 bytes big-endian, msgpack batch)          live, may drop (slow joiner,
                                                                     a full queue on either side)
    DEALER  sends (b"", start seq)  <- (b"", seq, batch) ... (b"", -1, run id)   the replay, on demand
            (vLLM's publisher answers (b"", topic, seq, batch) ... (b"", b"", -1, b""): read too;
            its topic is "" by default, ours "kv-events")

Sequence numbers say what was missed; the replay fills it in:

    live seq == applied + 1     apply
    live seq <= applied         already applied (a replay delivered it): skip
    live seq >  applied + 1     a gap: replay from applied + 1, apply those in order, then go on
    live seq <= last live seq   the publisher restarted (its numbers start again at 0):
                                ``on_reset``, then treat the batch as the first one
    first batch ever has seq > 0   the batches before it were missed: replay from 0
    a replay ends under a new run id   the publisher restarted (its SUB may not have reconnected
                                yet to show it): ``on_reset``, then replay from 0

A payload that does not decode is logged, counted and asked for again once through the replay; if
the replayed copy is bad too the batch is skipped (the index then misses what it said, which only
ever makes the router predict fewer hits or keep a page an eviction removed until the next clear).
When the replay cannot supply a missed batch (it was older than the publisher keeps, or there is
no replay endpoint) the count of ``lost`` batches says so and the stream goes on.

On start, and when ``resync`` is called (the router saw the engine restart), the subscriber asks
for a replay from 0, so a router that starts after its engine still learns what the engine holds.
A gap is only seen when a later batch arrives, so a lost *last* batch (the slow joiner's window
right after the start's replay, or the end of a burst) would wait for the engine's next change:
after ``idle_replay_s`` without the index moving the subscriber asks for a replay from the next
number it expects (an empty answer when nothing was missed). Not moving is silence, or live
batches it holds already: what a restarted engine's stream looks like to a subscriber that read
the whole previous run through the replay (its SUB joined late), whose numbers never went back;
the replay's end marker names the publisher's run, which tells. When that replay goes unanswered
(the engine is gone or restarting), the SUB socket is made anew: a fresh connect and
subscription rather than the old socket's reconnect schedule.

The thread owns both sockets (ZMQ sockets are not thread-safe); ``on_batch`` and ``on_reset`` run
on it, so they must be thread-safe with respect to whoever reads what they build.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import zmq

from epd_common.messages.kv_events import KVEventBatch, decode_batch

log = logging.getLogger("epd.llm_routing.kv_events")

END_SEQ = -1  # the replay's end marker, as 8 signed big-endian bytes
POLL_MS = 100  # how often the thread looks at its stop flag while waiting


def replay_frames(frames: list[bytes]) -> tuple[bytes, bytes] | None:
    """(seq, payload) of one replay message: ours is ``(b"", seq, payload)``, vLLM's
    ``(b"", topic, seq, payload)``; None for anything else."""
    if len(frames) == 3 and len(frames[1]) == 8:
        return frames[1], frames[2]
    if len(frames) == 4 and len(frames[2]) == 8:
        return frames[2], frames[3]
    return None


class SubscriberCounters(NamedTuple):
    batches: int  # batches applied (live or replayed)
    gaps: int  # jumps in the live sequence numbers
    replays: int  # replay requests sent
    resets: int  # publisher restarts seen in the sequence numbers, plus ``resync`` calls
    decode_errors: int  # payloads that did not decode (live or replayed)
    lost: int  # batches that neither the live stream nor a replay supplied


class KVEventSubscriber:
    """A daemon thread with a SUB on ``endpoint`` and, when given, a DEALER on ``replay_endpoint``."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        on_batch: Callable[[int, KVEventBatch], None],
        *,
        on_reset: Callable[[], None] | None = None,
        topic: str = "kv-events",
        replay_timeout_s: float = 2.0,
        sync_on_start: bool = True,
        idle_replay_s: float | None = 1.0,
    ) -> None:
        """``on_batch(seq, batch)``: called in sequence order, each seq at most once per publisher
        run. ``on_reset()``: the publisher restarted; what was built from earlier batches is stale.
        ``replay_timeout_s``: how long to wait for a replay's end marker before giving up on it.
        ``idle_replay_s``: how long the live stream may be silent before a catch-up replay (None:
        never)."""
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self._on_batch = on_batch
        self._on_reset = on_reset
        self._replay_timeout_s = replay_timeout_s
        self._sync_on_start = sync_on_start
        self._idle_replay_s = idle_replay_s
        self._stop = threading.Event()
        self._resync = threading.Event()
        self._thread: threading.Thread | None = None
        self._applied = -1  # last seq handed to on_batch (-1: none yet)
        self._live_last = -1  # last seq seen on the live stream
        self._dealer: zmq.Socket[bytes] | None = None
        self._run_id: bytes | None = None  # the publisher run the applied batches came from (None: any)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.batches = self.gaps = self.replays = self.resets = self.decode_errors = self.lost = 0

    # -- control (any thread) ---------------------------------------------------------------------
    def start(self) -> None:
        assert self._thread is None, "KVEventSubscriber.start() called twice"
        self._thread = threading.Thread(target=self._run, name=f"kv-events {self.endpoint}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 1.0) -> None:
        """Stop the thread; waits up to ``timeout_s`` (0: just ask it to stop)."""
        self._stop.set()
        if self._thread is not None and timeout_s > 0:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def resync(self) -> None:
        """Forget the sequence position and replay from 0 (the engine restarted under the same
        endpoint: its numbers may already be past ours, so the sequence alone cannot tell)."""
        self._resync.set()

    def counters(self) -> SubscriberCounters:
        return SubscriberCounters(
            self.batches, self.gaps, self.replays, self.resets, self.decode_errors, self.lost
        )

    # -- the thread -------------------------------------------------------------------------------
    def _subscribe(self) -> zmq.Socket[bytes]:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        return sub

    def _run(self) -> None:
        sub = self._subscribe()
        try:
            if self._sync_on_start:
                self._replay(0)
            quiet_since = time.monotonic()  # when the index last moved (or was last checked)
            idle = self._idle_replay_s
            while not self._stop.is_set():
                if self._resync.is_set():
                    self._resync.clear()
                    self._reset("resync requested")
                    self._replay(0)
                if idle is not None and time.monotonic() - quiet_since > idle:
                    if not self._replay(self._applied + 1):  # a lost last batch shows no gap
                        sub.close(0)  # unanswered: the engine went away; dial it afresh
                        sub = self._subscribe()
                    quiet_since = time.monotonic()
                if not sub.poll(POLL_MS):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    log.warning(
                        "%s: ignoring a malformed KV event message (%d frames)", self.endpoint, len(frames)
                    )
                    continue
                applied = self._applied
                self._receive_live(int.from_bytes(frames[1], "big"), frames[2])
                if self._applied != applied:
                    quiet_since = time.monotonic()
        except Exception:  # the thread must not die silently: the index would freeze
            log.exception("%s: KV event subscriber failed", self.endpoint)
        finally:
            sub.close(0)
            if self._dealer is not None:
                self._dealer.close(0)
                self._dealer = None

    def _receive_live(self, seq: int, payload: bytes) -> None:
        if seq <= self._live_last:
            self._reset(f"sequence went back from {self._live_last} to {seq}: publisher restarted")
        self._live_last = seq
        if seq <= self._applied:
            return  # a replay already delivered it
        if seq > self._applied + 1:
            self.gaps += 1
            self._replay(self._applied + 1)
            if seq <= self._applied:
                return
            if seq > self._applied + 1:
                self.lost += seq - self._applied - 1
                log.warning(
                    "%s: KV event batches %d..%d are lost (not in the replay)",
                    self.endpoint,
                    self._applied + 1,
                    seq - 1,
                )
        self._apply(seq, payload, may_replay=True)

    def _reset(self, why: str) -> None:
        log.info("%s: KV event index reset: %s", self.endpoint, why)
        self.resets += 1
        self._applied = -1
        self._live_last = -1
        self._run_id = None  # the next replay's run is the one followed from here
        if self._on_reset is not None:
            self._on_reset()

    def _apply(self, seq: int, payload: bytes, *, may_replay: bool) -> None:
        try:
            batch = decode_batch(payload)
        except ValueError as e:
            self.decode_errors += 1
            log.warning("%s: KV event batch %d does not decode: %s", self.endpoint, seq, e)
            if may_replay and self.replay_endpoint:
                self._replay(seq)
                if self._applied >= seq:
                    return
            self.lost += 1
            self._applied = seq  # skip it: asking forever would stall the stream
            return
        self._applied = seq
        try:
            self._on_batch(seq, batch)
        except Exception:  # a consumer's bug must not stop the stream; the batch counts as lost
            log.exception("%s: applying KV event batch %d failed", self.endpoint, seq)
            self.lost += 1
            return
        self.batches += 1

    def _replay(self, start: int) -> bool:
        """Ask for every kept batch from ``start`` and apply the ones not applied yet, in order.
        False when the publisher did not answer in time (True without a replay endpoint)."""
        if not self.replay_endpoint:
            return True
        dealer = self._replay_socket()
        self.replays += 1
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        deadline = time.monotonic() + self._replay_timeout_s
        while not self._stop.is_set():
            if not dealer.poll(POLL_MS):
                if time.monotonic() > deadline:
                    log.warning("%s: KV event replay from %d timed out", self.replay_endpoint, start)
                    self._drop_replay_socket()  # a late answer must not be read as the next one's
                    return False
                continue
            frames = replay_frames(dealer.recv_multipart())
            if frames is None:
                log.warning("%s: ignoring a malformed replay message", self.replay_endpoint)
                continue
            seq = int.from_bytes(frames[0], "big", signed=True)
            if seq == END_SEQ:
                run = frames[1] or None  # b"": a publisher that does not name its runs (vLLM)
                if run is not None and self._run_id is not None and run != self._run_id:
                    # what it sent before this marker came from the new run: the reset drops it
                    self._reset("the replay answered from a new run: the publisher restarted")
                    self._run_id = run
                    return self._replay(0)
                self._run_id = run if run is not None else self._run_id
                return True
            if seq <= self._applied:
                continue
            if seq > self._applied + 1:
                self.lost += seq - self._applied - 1  # older than the publisher keeps
            self._apply(seq, frames[1], may_replay=False)
        self._drop_replay_socket()
        return True  # stopped

    def _replay_socket(self) -> zmq.Socket[bytes]:
        if self._dealer is None:
            assert self.replay_endpoint
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.connect(self.replay_endpoint)
        return self._dealer

    def _drop_replay_socket(self) -> None:
        if self._dealer is not None:
            self._dealer.close(0)
            self._dealer = None
