"""KV copied into the pools, per request id: the state the copy-in paths keep, off the sequence.

Two kinds, both keyed by the request id (``Sequence.seq_id``):

- a copy-in source (``kv_source.KVSource``: positions [start, end) of a request whose KV is copied
  rather than computed): a prefill engine's hand-off (an import, registered when the request is
  queued; it lives until its KV is in the pools) or a host-tier restore (planned at admission by
  the KV manager; dropped at preemption, when the next admission plans anew);
- the store tier's fetch of a prompt's pages (``kv_store_tier.StoreFetch``) while it runs, then
  ``FETCH_SPENT``: a request asks the store once.

The KV manager owns the registry (``KVManager.transfers``); the scheduler forgets a request's
entries when it finishes or is aborted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llm_core.caches.kv_source import KVSource

if TYPE_CHECKING:
    from llm_core.caches.kv_store_tier import StoreFetch
    from llm_core.request import Sequence

RequestId = int | str


class KVTransfers:
    def __init__(self) -> None:
        self._sources: dict[RequestId, KVSource] = {}
        self._fetches: dict[RequestId, StoreFetch | str] = {}

    def source(self, request_id: RequestId) -> KVSource | None:
        """The request's copy-in source (None: its KV is computed)."""
        return self._sources.get(request_id)

    def set_source(self, request_id: RequestId, source: KVSource | None) -> None:
        if source is None:
            self._sources.pop(request_id, None)
        else:
            self._sources[request_id] = source

    def copying(self, seq: Sequence) -> bool:
        """Part of ``seq``'s KV is still to be copied in, not computed."""
        src = self._sources.get(seq.seq_id)
        return src is not None and seq.num_computed_tokens < src.end

    def fetch(self, request_id: RequestId) -> StoreFetch | str | None:
        """The request's store fetch (running or settled), ``FETCH_SPENT``, or None (never asked)."""
        return self._fetches.get(request_id)

    def set_fetch(self, request_id: RequestId, fetch: StoreFetch | str) -> None:
        self._fetches[request_id] = fetch

    def release(self, request_id: RequestId) -> None:
        """Forget a finished or aborted request."""
        self._sources.pop(request_id, None)
        self._fetches.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._sources.keys() | self._fetches.keys())
