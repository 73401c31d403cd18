"""Cross-request batching for an encoder: the queue, the dispatch and the forward streams, whatever
the unit of work (the vision tower's patches, ``batcher.EncodeBatcher``; an audio clip's mel frames,
``audio_batcher.AudioBatcher``).

Requests enqueue items; one dispatcher task packs queued items into a batch of at most ``budget``
units (the first item always goes, even when it alone is larger) and runs the forward in a forward
thread (torch releases the GIL), so the event loop keeps accepting, decoding and preprocessing the
next items while the current forward runs.

    time ─────────────────────────────────────────────────────────────▶
    loop:    enqueue a ─ enqueue b ─┐ enqueue c ─ enqueue d ─┐
    forward:                        └─[ a+b forward ]────────└─[ c+d forward ]─
                         ▲ dispatch when the budget is full or the oldest item
                           has waited max_wait_ms (items queued during a forward
                           are dispatched as soon as it ends)

``forward_streams`` > 1 runs that many forwards at once, each in its own thread. On a CPU this is
how a worker uses its cores: one single-threaded forward per core scales almost linearly, where
one forward with an intra-op thread per core synchronises its threads at every op (and stalls
whenever anything else wants a core). A free stream takes at most its fair share of the queue
(queued units / free streams, at least one item), so one stream never drains the queue while
the others go idle:

    queue: a b c d e f    both streams free ─▶ stream 0 takes a b c, stream 1 takes d e f
                          (were stream 1 busy, stream 0 would take up to the budget)

A subclass says what an item is: its size in units (``_validate``, which also refuses an item the
model cannot take), how a large item is cut into independent parts (``_split``: their outputs
concatenated are the item's), and the batched forward (``_forward``: one output tensor per item,
each what the item gets alone, up to float reassociation). If a batched forward raises, every item
of the batch is retried alone so that only the bad one fails. The queue is bounded in units;
``encode`` raises ``QueueFull`` beyond it (the worker answers 503 with Retry-After).

This module knows nothing of HTTP, media decoding, the models or the embedding cache.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

import torch

ItemT = TypeVar("ItemT")


class QueueFull(Exception):
    """The encoder queue holds more units than it may; retry later or elsewhere."""

    def __init__(self, queued_patches: int, limit: int, unit: str = "patches") -> None:
        self.queued_patches = queued_patches  # in the batcher's unit
        self.limit = limit
        super().__init__(f"encoder queue full: {queued_patches} {unit} queued (limit {limit})")


class EncodeResult(NamedTuple):
    embedding: torch.Tensor  # the item's rows [n, out_hidden] on output_device
    queue_ms: float  # enqueue -> forward start
    forward_ms: float  # the batched forward this item rode in (shared by the batch)
    batch_items: int


class BatcherStats(NamedTuple):
    """Counts since start; "patches" are the batcher's units (mel frames for audio)."""

    batches: int
    items: int
    patches: int
    failed_items: int
    retried_batches: int
    queue_items: int
    queue_patches: int
    last_batch_items: int
    last_batch_patches: int
    forward_s: float  # total time spent in forwards, summed over streams


@dataclass
class _Item(Generic[ItemT]):
    work: ItemT
    units: int
    future: asyncio.Future[EncodeResult]
    enqueued: float = field(default_factory=time.perf_counter)


class _BatchOutcome(NamedTuple):
    outputs: list[torch.Tensor | BaseException]
    started: float
    forward_s: float
    retried: bool


class ForwardBatcher(Generic[ItemT]):
    """Batches ``encode`` calls of ``ItemT`` items into shared forwards (the module docstring).

    ``budget``: most units in one forward (a larger single item runs alone).
    ``max_wait_ms``: longest an item waits for companions before its batch is dispatched.
    ``max_queue_units``: bound on queued units.
    ``forward_streams``: forwards that may run at once, each in its own thread.
    ``unit``: what a unit is called in messages ("patches", "mel frames").
    """

    def __init__(
        self,
        budget: int,
        max_wait_ms: float,
        max_queue_units: int,
        output_device: str | torch.device = "cpu",
        forward_streams: int = 1,
        unit: str = "patches",
        thread_name: str = "epd-encoder-forward",
    ) -> None:
        if budget <= 0:
            raise ValueError(f"budget must be positive, got {budget}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if forward_streams < 1:
            raise ValueError(f"forward_streams must be >= 1, got {forward_streams}")
        self.budget = budget
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_queue_units = max_queue_units
        self.output_device = torch.device(output_device)
        self.forward_streams = forward_streams
        self.unit = unit
        self._thread_name = thread_name
        self._pending: collections.deque[_Item[ItemT]] = collections.deque()
        self._queued = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._running: dict[asyncio.Task[None], list[_Item[ItemT]]] = {}  # forward task -> its batch
        self._free_streams = asyncio.Semaphore(forward_streams)
        self._executor: ThreadPoolExecutor | None = None
        self._batches = self._items = self._units = self._failed = self._retried = 0
        self._last_items = self._last_units = 0
        self._forward_s = 0.0

    # -- what an item is (subclasses) ----------------------------------------------------------------
    def _validate(self, item: ItemT) -> int:
        """The item's size in units; ``ValueError`` for one the model cannot take."""
        raise NotImplementedError

    def _split(self, item: ItemT) -> list[ItemT]:
        """Independent parts whose outputs, concatenated, are the item's ([item] when it fits)."""
        return [item]

    def _forward(self, items: list[ItemT]) -> list[torch.Tensor]:
        """Runs in a forward thread: one output [rows_i, out_hidden] per item, on output_device."""
        raise NotImplementedError

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        self._executor = ThreadPoolExecutor(
            max_workers=self.forward_streams, thread_name_prefix=self._thread_name
        )
        self._free_streams = asyncio.Semaphore(self.forward_streams)
        self._task = asyncio.create_task(self._dispatch_loop(), name="epd-encode-batcher")

    async def stop(self) -> None:
        """Stop dispatching; queued and in-flight items fail with RuntimeError (running forwards are
        allowed to finish in their threads before this returns)."""
        task, self._task = self._task, None
        # Collected first: a cancelled forward task removes its own entry from _running.
        stranded = [item for batch in self._running.values() for item in batch]
        tasks = [t for t in (task, *self._running) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        stranded += self._pending
        self._running.clear()
        self._pending.clear()
        for item in stranded:
            if not item.future.done():
                item.future.set_exception(RuntimeError("encoder batcher stopped"))
        self._queued = 0
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    async def __aenter__(self) -> ForwardBatcher[ItemT]:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- API ---------------------------------------------------------------------------------------
    async def encode(self, item: ItemT) -> torch.Tensor:
        """The embedding of one item: [rows, out_hidden]."""
        return (await self.encode_timed(item)).embedding

    async def encode_timed(self, item: ItemT) -> EncodeResult:
        """``encode`` with the item's queue and forward timings.

        An item ``_split`` cuts into parts is queued as its parts, back to back, so their forwards
        can go to several streams; the result is their rows concatenated. A split item's
        ``queue_ms`` is its first part's, ``forward_ms`` the sum of its parts' forwards.
        """
        if self._task is None:
            raise RuntimeError(f"{type(self).__name__}.start() was not awaited")
        n = self._validate(item)
        if self._pending and self._queued + n > self.max_queue_units:
            raise QueueFull(self._queued, self.max_queue_units, self.unit)
        loop = asyncio.get_running_loop()
        parts = self._split(item)
        items = [
            _Item(part, n if len(parts) == 1 else self._validate(part), loop.create_future())
            for part in parts
        ]
        self._pending.extend(items)
        self._queued += n
        self._wakeup.set()
        if len(items) == 1:
            return await items[0].future
        # Cancelling this call cancels every part still queued (gather cancels its children).
        results = await asyncio.gather(*(it.future for it in items), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        done = [r for r in results if isinstance(r, EncodeResult)]
        return EncodeResult(
            torch.cat([p.embedding for p in done]),  # parts in order
            done[0].queue_ms,
            sum(p.forward_ms for p in done),
            max(p.batch_items for p in done),
        )

    def stats(self) -> BatcherStats:
        return BatcherStats(
            batches=self._batches,
            items=self._items,
            patches=self._units,
            failed_items=self._failed,
            retried_batches=self._retried,
            queue_items=len(self._pending),
            queue_patches=self._queued,
            last_batch_items=self._last_items,
            last_batch_patches=self._last_units,
            forward_s=self._forward_s,
        )

    # -- internals ---------------------------------------------------------------------------------
    def _take_batch(self) -> list[_Item[ItemT]]:
        """Pop the next batch: arrival order, at most the budget or this stream's fair share of the
        queue among the free streams (whichever is smaller), and always at least one item."""
        free = self.forward_streams - len(self._running)  # this stream included
        assert free >= 1, "a batch is taken only by a stream that holds a free slot"
        share = -(-self._queued // free)  # ceil
        limit = min(self.budget, share)
        batch: list[_Item[ItemT]] = []
        total = 0
        while self._pending:
            item = self._pending[0]
            if item.future.done():  # caller gave up (cancelled) while queued
                self._pending.popleft()
                self._queued -= item.units
                continue
            if batch and total + item.units > limit:
                break
            self._pending.popleft()
            self._queued -= item.units
            batch.append(item)
            total += item.units
        return batch

    async def _wait_for_batch(self) -> None:
        """Return when the queue holds a budget's worth or its oldest item has waited max_wait."""
        while not self._pending:
            self._wakeup.clear()
            await self._wakeup.wait()
        deadline = self._pending[0].enqueued + self.max_wait_s
        while self._pending and self._queued < self.budget:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                return

    async def _dispatch_loop(self) -> None:
        while True:
            await self._free_streams.acquire()  # released when the forward started below ends
            try:
                await self._wait_for_batch()
                batch = self._take_batch()
            except BaseException:
                self._free_streams.release()
                raise
            if not batch:
                self._free_streams.release()
                continue
            task = asyncio.create_task(self._run_stream(batch), name="epd-encode-forward")
            self._running[task] = batch

    async def _run_stream(self, batch: list[_Item[ItemT]]) -> None:
        """One forward in a free stream; its slot and its entry in ``_running`` end with it."""
        loop = asyncio.get_running_loop()
        try:
            outcome = await loop.run_in_executor(self._executor, self._run_batch, [b.work for b in batch])
            self._record(batch, outcome)
        finally:
            self._running.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
            self._free_streams.release()

    def _record(self, batch: list[_Item[ItemT]], outcome: _BatchOutcome) -> None:
        forward_ms = outcome.forward_s * 1000.0
        self._batches += 1
        self._retried += int(outcome.retried)
        self._last_items = len(batch)
        self._last_units = sum(b.units for b in batch)
        self._forward_s += outcome.forward_s
        for item, out in zip(batch, outcome.outputs, strict=True):
            self._items += 1
            self._units += item.units
            if item.future.done():
                continue
            if isinstance(out, BaseException):
                self._failed += 1
                item.future.set_exception(out)
            else:
                queue_ms = (outcome.started - item.enqueued) * 1000.0
                item.future.set_result(EncodeResult(out, queue_ms, forward_ms, len(batch)))

    # Runs in the forward thread.
    def _run_batch(self, items: list[ItemT]) -> _BatchOutcome:
        started = time.perf_counter()
        outputs: list[torch.Tensor | BaseException]
        retried = False
        try:
            outputs = list(self._forward(items))
        except Exception as e:
            if len(items) == 1:
                outputs = [e]
            else:  # isolate the bad item(s): everyone else still gets an embedding
                outputs = [self._forward_or_error(p) for p in items]
                retried = True
        return _BatchOutcome(outputs, started, time.perf_counter() - started, retried)

    def _forward_or_error(self, item: ItemT) -> torch.Tensor | BaseException:
        try:
            return self._forward([item])[0]
        except Exception as e:
            return e
