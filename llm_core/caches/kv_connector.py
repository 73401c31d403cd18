"""KV connectors: one interface for KV copied into or out of the engine's pools.

Each way KV arrives by copy, or leaves, is a connector (the shape is vLLM v1's KV connector: the
scheduler side asks each connector, at fixed points of a request's life, what it can bring or
must send):

    admission, first                                     covers_prompt(seq)    the request brought
                                                         its prompt's KV: copy_in(seq, 0), nothing
                                                         borrowed, no other connector asked
    admission, before the prefix-cache hit is borrowed   must_wait(seq, hit)   its KV is on its way
    admission, after the hit is borrowed                 copy_in(seq, hit)     a KVSource from hit on
    after a step's forward                               copy_out(seqs, n, rows) KV leaving the engine
    the request finished or was aborted                  request_finished(id)  forget it

The KV manager consults its connectors at admission (``KVManager.match_prefix``, called by the
scheduler), the first source wins; the scheduler calls ``copy_out`` and ``request_finished``.
Implementations: the P/D import (``PromptImports``: a prefill engine's hand-off, registered when
the request is queued, handed over at admission ahead of every tier), the store tier
(``StoreTierConnector``: fetches a prompt's pages from the shared store while the request waits),
the host tier (``HostTierConnector``: evicted pages copied back), and the P/D export
(``serving/kv_handoff.py``: ``copy_out``). What a
connector keeps per request is keyed by request id (``kv_transfers.KVTransfers`` holds the
sources the scheduler plans copies from).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from epd_common.messages.page_hash import page_hashes
from llm_core.caches.host_restore import HostPage
from llm_core.caches.host_tier import HostKVTier
from llm_core.caches.kv_source import KVSource
from llm_core.caches.kv_store_tier import FETCH_SPENT, StoreFetch
from llm_core.caches.kv_transfers import KVTransfers, RequestId

if TYPE_CHECKING:
    from llm_core.request import Sequence


class KVConnector:
    """A connector that brings and sends nothing; implementations override the points they use."""

    def covers_prompt(self, seq: Sequence) -> bool:
        """True: ``seq`` brought its whole prompt's KV through this connector (``copy_in(seq, 0)``
        is its source; no prefix is borrowed and no other connector is asked)."""
        return False

    def must_wait(self, seq: Sequence, hit: int) -> bool:
        """True: ``seq`` (no pages yet, prefix-cache hit of ``hit`` tokens) must not be admitted
        this step, its KV is on its way; the scheduler asks again on a later step."""
        return False

    def copy_in(self, seq: Sequence, hit: int) -> KVSource | None:
        """KV this connector copies into ``seq``'s pages from position ``hit`` on (None: none)."""
        return None

    def copy_out(
        self, seqs: Seq[Sequence], num_new_tokens: Seq[int], page_rows: Seq[list[list[int]]]
    ) -> None:
        """After a step computed ``num_new_tokens[b]`` tokens of ``seqs[b]`` (its page rows
        ``page_rows[b]``), before the scheduler commits it (the sequences still hold the step's
        pages): send what leaves the engine."""

    def request_finished(self, request_id: RequestId) -> None:
        """The request finished or was aborted: forget it."""


class PromptImports(KVConnector):
    """Prompts' KV that requests bring with them (a prefill engine's hand-off, ``KVImport``): kept
    by request id from when the request is queued (``expect``) until its admission takes it as
    the copy-in source, or the request ends."""

    def __init__(self) -> None:
        self._pending: dict[RequestId, KVSource] = {}

    def expect(self, request_id: RequestId, source: KVSource) -> None:
        self._pending[request_id] = source

    def brings(self, request_id: RequestId) -> bool:
        """The request's prompt KV is here, not yet admitted (what admission's estimate asks)."""
        return request_id in self._pending

    def covers_prompt(self, seq: Sequence) -> bool:
        return seq.seq_id in self._pending

    def copy_in(self, seq: Sequence, hit: int) -> KVSource | None:
        return self._pending.pop(seq.seq_id, None)

    def request_finished(self, request_id: RequestId) -> None:
        self._pending.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._pending)


class StoreTierConnector(KVConnector):
    """The shared store below the host tier: a request whose prompt's next pages the store has
    (and fetching beats computing them) waits while they are fetched; a settled fetch's pages join
    the host tier, and the host connector copies them in. A request asks the store once."""

    def __init__(self, host: HostKVTier, transfers: KVTransfers, page_size: int) -> None:
        assert host.store is not None
        self.host = host
        self.store = host.store
        self.transfers = transfers
        self.page_size = page_size
        self._fetched: dict[RequestId, dict[int, HostPage]] = {}

    def must_wait(self, seq: Sequence, hit: int) -> bool:
        host, store, rid = self.host, self.store, seq.seq_id
        f = self.transfers.fetch(rid)
        if f is FETCH_SPENT:
            return False
        now = store.clock()
        if isinstance(f, StoreFetch):
            if not f.settled(now):
                return True
            self.transfers.set_fetch(rid, FETCH_SPENT)
            if not f.done.is_set():
                store.abandon(f)  # slower than recomputing would have been: recompute
                return False
            host.absorb(f.pages)
            self._fetched[rid] = dict(f.pages)
            return False
        self.transfers.set_fetch(rid, FETCH_SPENT)
        p = self.page_size
        usable, first = (seq.num_tokens - 1) // p, hit // p
        if usable <= first:
            return False
        hashes = page_hashes(seq.cache_keys[: usable * p], p)
        start = host.extent(hashes, first) if len(host) else first
        if start >= usable:
            return False
        n = usable - start
        recompute_s = n * p / host.cost.prefill_tokens_per_s
        if not store.worth_fetching(n, host.estimate_nbytes(n), recompute_s):
            return False
        self.transfers.set_fetch(
            rid, store.fetch(hashes[start:usable], deadline=now + max(recompute_s, store.min_wait_s))
        )
        return True

    def take_fetched(self, request_id: RequestId) -> dict[int, HostPage]:
        """The pages the request's settled fetch brought (once; {} when none)."""
        return self._fetched.pop(request_id, {})

    def request_finished(self, request_id: RequestId) -> None:
        self._fetched.pop(request_id, None)


class HostTierConnector(KVConnector):
    """Pages the prefix cache evicted to host memory (and a store fetch's pages): past the tree's
    hit, the next pages are copied back when the cost model says a copy beats computing them
    (fetched pages are always copied: the fetch was already judged worth it)."""

    def __init__(self, host: HostKVTier, page_size: int, store: StoreTierConnector | None) -> None:
        self.host = host
        self.page_size = page_size
        self.store = store

    def copy_in(self, seq: Sequence, hit: int) -> KVSource | None:
        host, p = self.host, self.page_size
        fetched = self.store.take_fetched(seq.seq_id) if self.store is not None else {}
        usable = (seq.num_tokens - 1) // p  # pages a hit may cover (one token is always computed)
        first = hit // p
        if usable <= first or not (len(host) or fetched):
            return None
        hashes = page_hashes(seq.cache_keys[: usable * p], p)
        end = host.extent(hashes, first, fetched)
        if end > first and (
            fetched or host.cost.fetch_is_faster(host.nbytes(hashes, first, end, fetched), (end - first) * p)
        ):
            return host.restore(hashes, first, end, fetched)
        return None
