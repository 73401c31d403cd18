"""The KV copies of one step: what of each copying sequence's chunk is copied and what computed,
and the copy itself, either before the forward or beside it, layer by layer.

A sequence copies while its chunk [c, c + n) starts inside its copy-in source [start, end)
(``caches/kv_source.py``, kept by request id in ``caches/kv_transfers.py``)::

    c + n <= end   copy [c, c + n), compute nothing; an import's last chunk yields its first_token
    c + n >  end   copy [c, end), compute [end, c + n) in the same step: a restore's chunk crossing
                   its end (``SchedulerConfig.kv_copy_overlap``)

``LayeredCopy`` runs the step's copies in one background thread, layer-major (every job's layer 0,
mark 0, every job's layer 1, mark 1, ...) while the forward of the computed parts runs; the
forward's layer i reads ``kv.layer(i)``, which waits for the mark (``caches/layer_gate.py``). So a
restored prefix costs no step of its own, and its copy hides behind the layers computed before it.
Only layer i of the copy has to be done before layer i of the forward: the copy of layer i + 1
runs while layer i computes.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Sequence as Seq
from types import TracebackType
from typing import NamedTuple

import torch

from llm_core.caches.kv_pool import PagedKVCache
from llm_core.caches.kv_source import KVSource
from llm_core.caches.kv_transfers import KVTransfers
from llm_core.caches.layer_gate import LayerGate
from llm_core.request import Sampled, Sequence


class CopyJob(NamedTuple):
    """Positions [lo, hi) of one sequence, copied from ``source`` into its pages."""

    source: KVSource
    rows: list[list[int]]  # the sequence's page row per KV group (``KVManager.rows``)
    lo: int
    hi: int


class CopyPlan(NamedTuple):
    """One step split into copies and computed parts.

    ``compute_seqs[k]`` computes ``compute_tokens[k]`` tokens for the batch's sequence
    ``compute_index[k]``: the sequence itself, or for a chunk crossing its copy's end a snapshot
    of it whose progress is that end (``_tail_of``). ``out``: each batch sequence's token so far
    (an import's first token where its copy completes the prompt, else None)."""

    jobs: list[CopyJob]
    compute_index: list[int]
    compute_seqs: list[Sequence]
    compute_tokens: list[int]
    out: list[Sampled]
    num_crossing: int  # chunks that copy and compute in this step


def plan_copies(
    seqs: Seq[Sequence], num_new_tokens: Seq[int], page_rows: Seq[list[list[int]]], transfers: KVTransfers
) -> CopyPlan:
    """Split the step's chunks at their sources' ends (see the module docstring; the sources are
    ``transfers``'; ``page_rows[b]``: ``seqs[b]``'s page row per KV group)."""
    plan = CopyPlan([], [], [], [], [None] * len(seqs), 0)
    crossing = 0
    for b, (s, n, rows) in enumerate(zip(seqs, num_new_tokens, page_rows, strict=True)):
        if not transfers.copying(s):
            plan.compute_index.append(b)
            plan.compute_seqs.append(s)
            plan.compute_tokens.append(n)
            continue
        src = transfers.source(s.seq_id)
        assert src is not None  # copying
        c, end = s.num_computed_tokens, src.end
        plan.jobs.append(CopyJob(src, rows, c, min(end, c + n)))
        if c + n > end:
            assert src.first_token is None, "an import's chunks never cross its end (nothing follows)"
            plan.compute_index.append(b)
            plan.compute_seqs.append(_tail_of(s, end))
            plan.compute_tokens.append(c + n - end)
            crossing += 1
        elif c + n == s.num_tokens:
            plan.out[b] = src.first_token
    return plan._replace(num_crossing=crossing)


def _tail_of(seq: Sequence, end: int) -> Sequence:
    """``seq`` as the computed tail of its crossing chunk sees it: progress at ``end``.

    A shallow copy: token lists, page tables, media and ``seq_id`` (the runner's generators and
    the position scheme's per-request state are keyed by it) are the live sequence's own objects,
    only ``num_computed_tokens`` differs. Everything ``prepare`` builds (ids, positions, page
    tables, write slots, media rows, sampling row) starts at ``num_computed_tokens``, so the tail
    packs like any chunk, and the live sequence, which the scheduler's ``update`` moves by the
    whole chunk, is left as it was."""
    tail = copy.copy(seq)
    tail.num_computed_tokens = end
    return tail


def copy_sequentially(kv: PagedKVCache, jobs: Seq[CopyJob]) -> None:
    """Every job's whole chunk, one after the other, on the calling thread."""
    for job in jobs:
        job.source.write(kv, job.rows, job.lo, job.hi)


class LayeredCopy:
    """``with LayeredCopy(kv, jobs): forward`` copies ``jobs`` beside the forward.

    On entry a ``LayerGate`` goes on ``kv`` and one thread starts copying layer by layer; on exit
    (also when the forward raised) the thread is joined and the gate removed. A forward that
    raised cancels the copy at its next layer (the batch is failed anyway). A copier that raised
    fails the gate (the waiting forward raises ``LayerCopyFailed``) and its exception is re-raised
    here, the root cause, with the forward's error as its context.

    On CUDA the copier enqueues its copies on the stream the forward runs on (the current one at
    entry), so a kernel the forward enqueues after ``wait(i)`` runs after layer i's copies."""

    def __init__(self, kv: PagedKVCache, jobs: Seq[CopyJob]) -> None:
        self._kv = kv
        self._jobs = list(jobs)
        self._gate = LayerGate(kv.num_layers)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._copy, name="kv-copy", daemon=True)
        device = kv.layer_storage(0).k.device
        self._stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def __enter__(self) -> LayeredCopy:
        assert self._kv.gate is None, "one layered copy at a time"
        self._kv.gate = self._gate
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None:
            self._gate.fail(exc)  # the copier stops before its next layer
        self._thread.join()
        self._kv.gate = None
        if self._error is not None:
            raise self._error

    def _copy(self) -> None:
        kv, gate = self._kv, self._gate
        stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        try:
            # inference mode as on the engine thread (it is per thread): the pool tensors may be
            # inference tensors, which only take in-place writes inside it
            with torch.inference_mode(), stream:
                for i in range(kv.num_layers):
                    if gate.error is not None:
                        return  # the forward gave up
                    for job in self._jobs:
                        job.source.write_layer(kv, i, job.rows, job.lo, job.hi)
                    gate.mark_ready(i)
        except BaseException as e:  # handed to the forward's thread: re-raised there
            self._error = e
            gate.fail(e)
