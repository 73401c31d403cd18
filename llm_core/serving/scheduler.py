"""Continuous-batching scheduler: decode first, then chunked prefill shared fairly by length bucket.

One ``schedule()`` call plans one model step under a token budget:

1. Every running decode sequence gets 1 token (oldest first). When KV runs out, the newest
   running sequence not yet in this step is preempted by recompute (its KV goes back to the
   prefix cache, it returns to the waiting queue with ``num_computed_tokens = 0``); if there is
   none, the sequence itself waits a step. Never a crash.
2. The rest of the budget goes to prefill (while streams decode, at most what keeps the step within
   its target time: ``step_cost.py``, when the engine measures it), split max-min fairly between
   length buckets that have prefill work (waiting_queue.py). Within a bucket, sequences already prefilling continue first,
   then waiting ones are admitted in priority order (cache hit, uncached tokens, waiting time).
   A chunk is cut to the bucket's share, ``max_prefill_chunk`` and what the pools can hold; it
   may be smaller than the window. Admission never preempts.

``update()`` commits the step (KV manager frees SWA pages that left the window), appends sampled
tokens and finishes sequences on a stop token or length. The scheduler owns the waiting queue
and the KV manager's policy calls; it knows nothing of tensors, sampling or tokenization.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from llm_core.caches.kv_connector import KVConnector
from llm_core.caches.kv_manager import KVManager
from llm_core.caches.kv_source import KVSource
from llm_core.request import Sampled, Sequence, SequenceStatus
from llm_core.serving.draft_state import DraftStates
from llm_core.serving.scheduler_output import SchedulerOutput
from llm_core.serving.step_cost import StepCost
from llm_core.serving.waiting_queue import PriorityWeights, WaitingQueue, fair_split


class SchedulerError(Exception):
    """A request the scheduler refuses; ``status`` is the HTTP status the server maps it to."""

    status = 400


class RequestTooLarge(SchedulerError):
    """The request can never fit: over the model length or the KV pools (400)."""


class QueueFull(SchedulerError):
    """The waiting queue is at capacity; retry later (503)."""

    status = 503


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192  # tokens computed per step, decode + prefill
    max_prefill_chunk: int | None = None  # per-sequence cap on one step's prefill chunk
    max_model_len: int = 1 << 20
    max_waiting: int = 4096
    bucket_bounds: tuple[int, ...] = (64 * 1024, 256 * 1024, 1024 * 1024)
    hit_weight: float = 0.5
    wait_tokens_per_s: float = 1024.0
    # A chunk of a restore (a copy-in source without ``first_token``) may cross the copy's end: the
    # runner copies the part before it beside the forward of the rest (``serving/kv_copy.py``).
    kv_copy_overlap: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(f"need max_num_seqs >= 1 and max_num_batched_tokens >= 1: {self}")
        if not self.bucket_bounds or list(self.bucket_bounds) != sorted(self.bucket_bounds):
            raise ValueError(f"bucket_bounds must be non-empty and ascending: {self.bucket_bounds}")


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVManager, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting = WaitingQueue(
            config.bucket_bounds, PriorityWeights(config.hit_weight, config.wait_tokens_per_s)
        )
        self.running: list[Sequence] = []  # admission order: oldest first
        self._by_id: dict[int | str, Sequence] = {}
        self._rr = 0
        self.num_preemptions = 0
        # Connectors beyond the KV manager's (``caches/kv_connector.py``; the engine's P/D one).
        self.connectors: list[KVConnector] = []
        # The speculator's per-request drafts (set by the engine when it speculates).
        self.drafts: DraftStates | None = None
        # The measured step cost that bounds prefill beside decodes (set by the engine).
        self.step_cost: StepCost | None = None

    # ---- requests ------------------------------------------------------------------------
    def add(self, seq: Sequence, kv_import: KVSource | None = None) -> None:
        """Queue a new sequence; RequestTooLarge if it can never run, QueueFull when saturated.
        ``kv_import``: its prompt's KV from a prefill engine (copied in, not computed)."""
        total = seq.num_tokens + seq.max_new_tokens
        if total > self.config.max_model_len:
            raise RequestTooLarge(
                f"request {seq.seq_id!r}: {seq.num_tokens} prompt + {seq.max_new_tokens} new tokens "
                f"exceed max_model_len {self.config.max_model_len}"
            )
        why = self.kv.capacity_error(math.ceil(total / self.kv.page_size))
        if why is not None:
            raise RequestTooLarge(f"request {seq.seq_id!r}: {why}")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"waiting queue is full ({self.config.max_waiting} requests)")
        if seq.seq_id in self._by_id:
            raise SchedulerError(f"duplicate sequence id {seq.seq_id!r}")
        seq.status = SequenceStatus.WAITING
        self.waiting.add(seq)
        self._by_id[seq.seq_id] = seq
        if kv_import is not None:  # handed over as its copy-in source at admission
            self.kv.imports.expect(seq.seq_id, kv_import)

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def abort(self, seq_id: int | str) -> Sequence | None:
        """Cancel a sequence wherever it is; its KV is released. None when unknown or done."""
        return self._stop(seq_id, SequenceStatus.ABORTED, "abort")

    def finish(self, seq_id: int | str, reason: str = "stop") -> Sequence | None:
        """Finish a sequence the engine decided to stop (e.g. a stop string matched)."""
        return self._stop(seq_id, SequenceStatus.FINISHED, reason)

    def _stop(self, seq_id: int | str, status: SequenceStatus, reason: str) -> Sequence | None:
        seq = self._by_id.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.kv.release(seq)
        else:
            self.waiting.remove(seq)
        self.kv.request_finished(seq_id)
        for connector in self.connectors:
            connector.request_finished(seq_id)
        seq.status = status
        seq.finish_reason = reason
        return seq

    # ---- planning ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput | None:
        """Plan one step (pages allocated); None when there is nothing to compute."""
        budget = self.config.max_num_batched_tokens
        plan: dict[int, int] = {}  # id(seq) -> tokens this step
        seqs: list[Sequence] = []

        def take(seq: Sequence, n: int) -> None:
            plan[id(seq)] = n
            seqs.append(seq)

        prefilling: list[Sequence] = []  # running sequences with prefill left (none planned here)
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.in_prefill:
                prefilling.append(seq)
            elif budget > 0 and self._allocate_or_preempt(seq, 1, plan):
                n = 1 + self._drafts_to_verify(seq, budget - 1)
                take(seq, n)
                budget -= n
        prefilling = [s for s in prefilling if s.status is SequenceStatus.RUNNING]
        if self.step_cost is not None:  # running streams wait on this step: bound its prefill
            budget = self.step_cost.prefill_budget(len(seqs), budget)

        # With no prefill running and nothing waiting (a decode-only step) every bucket's demand is 0.
        if prefilling or len(self.waiting):
            by_bucket = [self._prefill_demand(b, prefilling) for b in range(self.waiting.num_buckets)]
        else:
            by_bucket = [0] * self.waiting.num_buckets
        grants = fair_split(by_bucket, budget, start=self._rr)
        self._rr += 1
        for b, grant in enumerate(grants):
            if grant:
                self._fill_bucket(b, grant, plan, take)
        if not seqs:
            return None
        return SchedulerOutput.build(
            seqs, [plan[id(s)] for s in seqs], [self.kv.rows(s) for s in seqs], self.kv.transfers
        )

    def _drafts_to_verify(self, seq: Sequence, budget: int) -> int:
        """How many of ``seq``'s drafts (``speculative.py``) this step verifies: all that fit the
        budget, the output and length limits, and KV pages (allocated here; none is preempted for
        a draft). Its page for the token itself is allocated already."""
        if self.drafts is None:
            return 0
        drafts = self.drafts.drafts(seq.seq_id)
        n = max(
            0,
            min(
                len(drafts),
                budget,
                seq.max_new_tokens - len(seq.output_ids) - 1,
                self.config.max_model_len - seq.num_tokens - 1,
            ),
        )
        while n > 0 and not self.kv.allocate(seq, 1 + n):
            n -= 1
        self.drafts.keep(seq.seq_id, n)
        return n

    def _reset_speculation(self, seq: Sequence, start: int) -> None:
        if self.drafts is not None:
            self.drafts.reset(seq.seq_id, start)

    def _prefill_demand(self, b: int, prefilling: list[Sequence]) -> int:
        """Prefill tokens bucket ``b`` could use: its running ``prefilling`` sequences' and its waiting ones'."""
        bucket_of = self.waiting.bucket_of
        running = sum(s.num_uncomputed_tokens for s in prefilling if bucket_of(s.num_tokens) == b)
        return running + sum(s.num_uncomputed_tokens for s in self.waiting.bucket(b))

    def _chunk_cap(self) -> int:
        return self.config.max_prefill_chunk or self.config.max_num_batched_tokens

    def _chunk_limit(self, seq: Sequence) -> int:
        """The most prefill tokens ``seq`` may take this step. A chunk that copies KV in stops at
        the copy's end, except a restore's with ``kv_copy_overlap``: its part past ``end`` is
        computed in the same step, beside the copy. An import always stops there: it covers the
        whole prompt and brings the token after it (nothing is left to compute)."""
        n = min(seq.num_uncomputed_tokens, self._chunk_cap())
        src = self.kv.transfers.source(seq.seq_id)
        if (
            self.kv.transfers.copying(seq)
            and src is not None
            and not (self.config.kv_copy_overlap and src.first_token is None)
        ):
            n = min(n, src.end - seq.num_computed_tokens)
        return n

    def _fill_bucket(
        self, b: int, grant: int, plan: dict[int, int], take: Callable[[Sequence, int], None]
    ) -> None:
        left = grant
        for seq in list(self.running):
            if left == 0:
                return
            if not seq.in_prefill or id(seq) in plan or self.waiting.bucket_of(seq.num_tokens) != b:
                continue
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            n = self._fit(seq, min(self._chunk_limit(seq), left))
            if n == 0:
                if not self._allocate_or_preempt(seq, 1, plan):
                    continue  # wait a step; planned sequences will free KV as they finish
                n = 1
            else:
                ok = self.kv.allocate(seq, n)  # _fit() checked it fits
                assert ok
            take(seq, n)
            left -= n
        if left == 0 or len(self.running) >= self.config.max_num_seqs or not self.waiting.bucket(b):
            return
        now = self.clock()
        for seq in self.waiting.ordered(b, now, self.kv.peek_prefix):
            if left == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if self.kv.match_prefix(seq) is None:  # the connectors: an import, a hit, a restore
                continue  # its prefix's KV is on its way from the store: admitted once it is here
            # MTP KV from the first position this sequence computes (``speculative.py``)
            src = self.kv.transfers.source(seq.seq_id)  # an import's, or a restore planned just now
            self._reset_speculation(seq, src.end if src is not None else seq.num_computed_tokens)
            n = self._fit(seq, min(self._chunk_limit(seq), left))
            if n == 0:
                self.kv.release(seq, cache=False)
                seq.num_computed_tokens = 0
                seq.num_cached_tokens = 0
                return  # KV is full: admit nothing more this step (admission never preempts)
            ok = self.kv.allocate(seq, n)
            assert ok
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            take(seq, n)
            left -= n

    def _fit(self, seq: Sequence, n: int) -> int:
        """Largest chunk <= ``n`` whose pages the pools can provide (halving), 0 if not even 1 token."""
        n = max(n, 1)
        while n > 1 and not self.kv.can_allocate(seq, n):
            n //= 2
        return n if self.kv.can_allocate(seq, n) else 0

    def _allocate_or_preempt(self, seq: Sequence, n: int, plan: dict[int, int]) -> bool:
        """Allocate ``n`` tokens for a running ``seq``, preempting newer unplanned sequences if needed."""
        while not self.kv.allocate(seq, n):
            newer = self.running[self.running.index(seq) + 1 :]
            victim = next((s for s in reversed(newer) if id(s) not in plan), None)
            if victim is None:
                return False
            self._preempt(victim)
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: KV back to the prefix cache, progress reset, back in the waiting queue."""
        self.running.remove(seq)
        self.kv.release(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
        seq.num_preemptions += 1
        self._reset_speculation(seq, 0)
        seq.status = SequenceStatus.WAITING
        self.waiting.add(seq)
        self.num_preemptions += 1

    # ---- results -------------------------------------------------------------------------
    def copy_out(self, step: SchedulerOutput) -> None:
        """After the step's forward, before ``update``: every connector sends what leaves the
        engine (a P/D export of a prompt this step completed; its pages are still held)."""
        for connector in (*self.kv.connectors, *self.connectors):
            connector.copy_out(step.seqs, step.num_new_tokens, step.page_rows)

    def update(self, batch: SchedulerOutput, sampled: list[Sampled]) -> list[Sequence]:
        """Commit a computed step; ``sampled[i]`` is the token sampled for ``seqs[i]`` (None
        mid-prefill), or the tokens a verify step accepted (a list: only the positions they
        cover are committed; the rejected drafts' KV is overwritten by the next step). A list
        entry is cut, in place, to the tokens appended (a stop token or a limit ends it early).

        Returns the sequences that finished in this step (their KV already released).
        """
        finished: list[Sequence] = []
        commit, running, transfers = self.kv.commit, SequenceStatus.RUNNING, self.kv.transfers
        for seq, n, tok in zip(batch.seqs, batch.num_new_tokens, sampled, strict=True):
            if seq.status is not running:
                continue  # aborted while the step ran
            if isinstance(tok, list):  # a verify step: cut at a stop token or a limit, then commit
                reason = None
                for k, t in enumerate(tok):
                    reason = self._finish_reason(seq, t, len(seq.output_ids) + k + 1)
                    if reason is not None:
                        del tok[k + 1 :]
                        break
                commit(
                    seq, len(tok)
                )  # positions n-1 .. n-2+len: the last known token and the accepted drafts
                seq.output_ids.extend(tok)
            else:
                commit(seq, n)
                src = transfers.source(seq.seq_id)
                if src is not None and seq.num_computed_tokens >= src.end:
                    transfers.set_source(
                        seq.seq_id, None
                    )  # the copied KV is in the pools now; let its buffers go
                if seq.num_computed_tokens < seq.num_tokens:
                    continue  # a prefill chunk: no token yet
                assert tok is not None, (
                    f"seq {seq.seq_id}: step completed its tokens but no token was sampled"
                )
                seq.output_ids.append(tok)
                reason = self._finish_reason(seq, tok, len(seq.output_ids))
            if reason is not None:
                self._stop(seq.seq_id, SequenceStatus.FINISHED, reason)
                finished.append(seq)
        return finished

    def _finish_reason(self, seq: Sequence, tok: int, num_output: int) -> str | None:
        """Why ``seq`` ends once ``tok`` is its ``num_output``-th output token, or None."""
        if tok in seq.stop_token_ids:
            return "stop"
        if num_output >= seq.max_new_tokens or len(seq.prompt_ids) + num_output >= self.config.max_model_len:
            return "length"
        return None

    def token_load(self) -> tuple[int, int]:
        """(tokens left to prefill, tokens of the sequences decoding): the load a router balances.
        Waiting sequences count their whole uncomputed prompt (their prefix hit is not known yet)."""
        prefill = sum(s.num_uncomputed_tokens for s in self.waiting)
        decode = 0
        for s in self.running:
            if s.in_prefill:
                prefill += s.num_uncomputed_tokens
            else:
                decode += s.num_tokens
        return prefill, decode

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
