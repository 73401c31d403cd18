"""Cross-request batching for the vision encoder.

Requests enqueue their patches; one dispatcher task packs queued items into a batch of at most
``patch_budget`` patches (the first item always goes, even when it alone is larger) and runs the
forward in a forward thread (torch releases the GIL), so the event loop keeps accepting,
decoding and preprocessing the next items while the current forward runs.

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
(queued patches / free streams, at least one item), so one stream never drains the queue while
the others go idle:

    queue: a b c d e f    both streams free ─▶ stream 0 takes a b c, stream 1 takes d e f
                          (were stream 1 busy, stream 0 would take up to the budget)

Items are packed in arrival order; attention never crosses items, so each item's rows equal what
it gets alone (up to float reassociation). If a batched forward raises, every item of the batch
is retried alone so that only the bad one fails. The queue is bounded in patches; ``encode``
raises ``QueueFull`` beyond it (the worker answers 503 with Retry-After).

This module knows nothing of HTTP, media decoding or the embedding cache.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from encoder.models.family import VisionTower
from media_io.preprocess import Patches


class QueueFull(Exception):
    """The encoder queue holds more patches than it may; retry later or elsewhere."""

    def __init__(self, queued_patches: int, limit: int) -> None:
        self.queued_patches = queued_patches
        self.limit = limit
        super().__init__(f"encoder queue full: {queued_patches} patches queued (limit {limit})")


class EncodeResult(NamedTuple):
    embedding: torch.Tensor  # [t*h*w // merge_unit, out_hidden] on output_device
    queue_ms: float  # enqueue -> forward start
    forward_ms: float  # the batched forward this item rode in (shared by the batch)
    batch_items: int


class BatcherStats(NamedTuple):
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
class _Item:
    patches: Patches
    num_patches: int
    future: asyncio.Future[EncodeResult]
    enqueued: float = field(default_factory=time.perf_counter)


class _BatchOutcome(NamedTuple):
    outputs: list[torch.Tensor | BaseException]
    started: float
    forward_s: float
    retried: bool


class EncodeBatcher:
    """Batches ``encode`` calls into shared forwards of ``model``.

    ``patch_budget``: most patches in one forward (a larger single item runs alone).
    ``max_wait_ms``: longest an item waits for companions before its batch is dispatched.
    ``max_queue_patches``: bound on queued patches (default 8 budgets, at least 524288 so that a
    small CPU budget still queues half a dozen one-minute videos, ~72k patches each at 640x360).
    ``forward_streams``: forwards that may run at once, each in its own thread.
    """

    def __init__(
        self,
        model: VisionTower,
        patch_budget: int = 16384,
        max_wait_ms: float = 5.0,
        max_queue_patches: int | None = None,
        output_device: str | torch.device = "cpu",
        forward_streams: int = 1,
    ) -> None:
        if patch_budget <= 0:
            raise ValueError(f"patch_budget must be positive, got {patch_budget}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if forward_streams < 1:
            raise ValueError(f"forward_streams must be >= 1, got {forward_streams}")
        self.model = model
        self.patch_budget = patch_budget
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_queue_patches = (
            max_queue_patches if max_queue_patches is not None else max(8 * patch_budget, 1 << 19)
        )
        self.output_device = torch.device(output_device)
        self.forward_streams = forward_streams
        self._pending: collections.deque[_Item] = collections.deque()
        self._queued_patches = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._running: dict[asyncio.Task[None], list[_Item]] = {}  # forward task -> its batch
        self._free_streams = asyncio.Semaphore(forward_streams)
        self._executor: ThreadPoolExecutor | None = None
        self._batches = self._items = self._patches = self._failed = self._retried = 0
        self._last_items = self._last_patches = 0
        self._forward_s = 0.0

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        self._executor = ThreadPoolExecutor(
            max_workers=self.forward_streams, thread_name_prefix="epd-encoder-forward"
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
        self._queued_patches = 0
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    async def __aenter__(self) -> EncodeBatcher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- API ---------------------------------------------------------------------------------------
    async def encode(self, patches: Patches) -> torch.Tensor:
        """The embedding of one item: [t*h*w // merge_unit, out_hidden]."""
        return (await self.encode_timed(patches)).embedding

    async def encode_timed(self, patches: Patches) -> EncodeResult:
        """``encode`` with the item's queue and forward timings.

        A multi-frame item (video) larger than the budget is split into runs of whole frames of at
        most a budget each, queued back to back, so its forwards can go to several streams and no
        forward exceeds the budget. Attention never crosses a frame, so the concatenated parts
        equal the item encoded whole (up to float reassociation). A split item's ``queue_ms`` is
        its first part's, ``forward_ms`` the sum of its parts' forwards.
        """
        if self._task is None:
            raise RuntimeError("EncodeBatcher.start() was not awaited")
        n = self._validate(patches)
        if self._pending and self._queued_patches + n > self.max_queue_patches:
            raise QueueFull(self._queued_patches, self.max_queue_patches)
        loop = asyncio.get_running_loop()
        items = [_Item(part, part.num_patches, loop.create_future()) for part in self._split(patches)]
        self._pending.extend(items)
        self._queued_patches += n
        self._wakeup.set()
        if len(items) == 1:
            return await items[0].future
        # Cancelling this call cancels every part still queued (gather cancels its children).
        parts = await asyncio.gather(*(it.future for it in items), return_exceptions=True)
        for part in parts:
            if isinstance(part, BaseException):
                raise part
        done = [p for p in parts if isinstance(p, EncodeResult)]
        return EncodeResult(
            torch.cat([p.embedding for p in done]),  # frames in order: [sum t_i*h*w // unit, out]
            done[0].queue_ms,
            sum(p.forward_ms for p in done),
            max(p.batch_items for p in done),
        )

    def _split(self, patches: Patches) -> list[Patches]:
        """Runs of whole frames of at most ``patch_budget`` patches (one frame when a frame alone is
        larger); the item itself when it fits or has one frame.

            rows:  [ frame 0 | frame 1 | frame 2 | frame 3 | frame 4 ]   t=5, budget = 2 frames
            parts: [ f0 f1 ][ f2 f3 ][ f4 ]
        """
        t, h, w = patches.grid_thw
        if t == 1 or t * h * w <= self.patch_budget:
            return [patches]
        per = max(1, self.patch_budget // (h * w))  # frames per part
        return [
            Patches(patches.pixel_values[f * h * w : min(t, f + per) * h * w], (min(t, f + per) - f, h, w))
            for f in range(0, t, per)
        ]

    def stats(self) -> BatcherStats:
        return BatcherStats(
            batches=self._batches,
            items=self._items,
            patches=self._patches,
            failed_items=self._failed,
            retried_batches=self._retried,
            queue_items=len(self._pending),
            queue_patches=self._queued_patches,
            last_batch_items=self._last_items,
            last_batch_patches=self._last_patches,
            forward_s=self._forward_s,
        )

    # -- internals ---------------------------------------------------------------------------------
    def _validate(self, patches: Patches) -> int:
        cfg = self.model.config
        t, h, w = patches.grid_thw
        pv = patches.pixel_values
        if t < 1 or h < 1 or w < 1 or h % cfg.spatial_merge_size or w % cfg.spatial_merge_size:
            raise ValueError(f"grid_thw {patches.grid_thw} is not a positive grid of whole merge groups")
        if pv.dim() != 2 or tuple(pv.shape) != (t * h * w, cfg.patch_dim):
            raise ValueError(
                f"pixel_values shape {tuple(pv.shape)} does not match grid_thw {patches.grid_thw} "
                f"(expected ({t * h * w}, {cfg.patch_dim}))"
            )
        return t * h * w

    def _take_batch(self) -> list[_Item]:
        """Pop the next batch: arrival order, at most the budget or this stream's fair share of the
        queue among the free streams (whichever is smaller), and always at least one item."""
        free = self.forward_streams - len(self._running)  # this stream included
        assert free >= 1, "a batch is taken only by a stream that holds a free slot"
        share = -(-self._queued_patches // free)  # ceil
        limit = min(self.patch_budget, share)
        batch: list[_Item] = []
        total = 0
        while self._pending:
            item = self._pending[0]
            if item.future.done():  # caller gave up (cancelled) while queued
                self._pending.popleft()
                self._queued_patches -= item.num_patches
                continue
            if batch and total + item.num_patches > limit:
                break
            self._pending.popleft()
            self._queued_patches -= item.num_patches
            batch.append(item)
            total += item.num_patches
        return batch

    async def _wait_for_batch(self) -> None:
        """Return when the queue holds a budget's worth or its oldest item has waited max_wait."""
        while not self._pending:
            self._wakeup.clear()
            await self._wakeup.wait()
        deadline = self._pending[0].enqueued + self.max_wait_s
        while self._pending and self._queued_patches < self.patch_budget:
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

    async def _run_stream(self, batch: list[_Item]) -> None:
        """One forward in a free stream; its slot and its entry in ``_running`` end with it."""
        loop = asyncio.get_running_loop()
        try:
            outcome = await loop.run_in_executor(self._executor, self._run_batch, [b.patches for b in batch])
            self._record(batch, outcome)
        finally:
            self._running.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
            self._free_streams.release()

    def _record(self, batch: list[_Item], outcome: _BatchOutcome) -> None:
        forward_ms = outcome.forward_s * 1000.0
        self._batches += 1
        self._retried += int(outcome.retried)
        self._last_items = len(batch)
        self._last_patches = sum(b.num_patches for b in batch)
        self._forward_s += outcome.forward_s
        for item, out in zip(batch, outcome.outputs, strict=True):
            self._items += 1
            self._patches += item.num_patches
            if item.future.done():
                continue
            if isinstance(out, BaseException):
                self._failed += 1
                item.future.set_exception(out)
            else:
                queue_ms = (outcome.started - item.enqueued) * 1000.0
                item.future.set_result(EncodeResult(out, queue_ms, forward_ms, len(batch)))

    # Runs in the forward thread.
    def _run_batch(self, items: list[Patches]) -> _BatchOutcome:
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

    def _forward_or_error(self, item: Patches) -> torch.Tensor | BaseException:
        try:
            return self._forward([item])[0]
        except Exception as e:
            return e

    def _forward(self, items: list[Patches]) -> list[torch.Tensor]:
        model = self.model
        grids = [p.grid_thw for p in items]
        layout = model.layout(grids)
        if len(items) == 1:
            pixels = items[0].pixel_values
        else:
            # One staging buffer (pinned when the model is on CUDA, so the upload is asynchronous).
            total = sum(p.pixel_values.shape[0] for p in items)
            pin = model.device.type == "cuda"
            pixels = torch.empty((total, model.config.patch_dim), dtype=torch.float32, pin_memory=pin)
            offset = 0
            for p in items:
                n = p.pixel_values.shape[0]
                pixels[offset : offset + n].copy_(p.pixel_values)  # [n, patch_dim]
                offset += n
        with torch.inference_mode():
            out = model.forward_layout(pixels, layout)  # [N // unit, out_hidden]
            out = out.to(self.output_device)
        unit = model.config.merge_unit
        sizes = [t * h * w // unit for t, h, w in grids]
        # Clone so one kept embedding does not pin the whole batch's output buffer.
        return [part.clone() for part in out.split(sizes)] if len(items) > 1 else [out]
