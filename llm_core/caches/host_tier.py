"""The host tier below the prefix cache: pages the radix tree evicts, kept in host memory and
copied back when a later request's prefix reaches them.

    tree evicts a leaf ──spill (before its pages are freed)──▶ host pages by content hash:
        every layer's KV for full-attention layers, SWA layers' KV where the tree still had it live
    a request's tree hit ends at h ──its page hashes from h on──▶ the longest boundary b whose
        pages [h, b) are all here and whose SWA window before b is here too (the tree's own hit
        rule) ──▶ a ``HostRestore``: the scheduler plans [h, b) as prefill chunks that the model
        runner copies (``caches/kv_source.py``), then the rest is computed

Only what a resumed request can read is kept for SWA layers: the tree tombstones SWA pages outside
the window of its node boundaries before it evicts whole nodes, so a spilled node carries SWA KV for
the window at its end and full KV for every page. Pages are named by ``page_hash.page_hashes`` (a
page's name covers its whole prefix), held least recently used first within ``capacity_bytes``.
Whether a copy beats recomputing is the ``FetchCostModel``'s call (measured copy bandwidth against
measured prefill throughput). Engine thread only: spills happen inside the tree's eviction, restores
inside the runner's step.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import NamedTuple

import torch

from epd_common.messages.hit_rule import groups_accept
from llm_core.caches.host_restore import FetchCostModel, HostPage, HostRestore
from llm_core.caches.kv_pool import PagedKVCache
from llm_core.caches.kv_store_tier import KVStoreTier


class HostTierStats(NamedTuple):
    pages: int
    bytes: int
    capacity_bytes: int
    spilled_pages: int
    evicted_pages: int
    restores: int
    restored_tokens: int
    pages_from_store: int


class HostKVTier:
    def __init__(
        self,
        kv: PagedKVCache,
        capacity_bytes: int,
        store: KVStoreTier | None = None,
        store_policy: str = "write_through",
    ) -> None:
        """``store``: the tier below (``kv_store_tier.py``); ``store_policy`` says which pages go
        there: "write_through" (every spilled page) or "host_evict" (pages this tier drops)."""
        assert store_policy in ("write_through", "host_evict"), store_policy
        self.kv = kv
        self.page_size = kv.page_size
        self.capacity_bytes = capacity_bytes
        self.store = store
        self.store_policy = store_policy
        self.cost = FetchCostModel()
        self._pages: collections.OrderedDict[int, HostPage] = collections.OrderedDict()
        self.used_bytes = 0
        self.spilled_pages = 0
        self.evicted_pages = 0
        self.restores = 0
        self.restored_tokens = 0
        self.pages_from_store = 0

    def __len__(self) -> int:
        return len(self._pages)

    def stats(self) -> HostTierStats:
        return HostTierStats(
            len(self._pages),
            self.used_bytes,
            self.capacity_bytes,
            self.spilled_pages,
            self.evicted_pages,
            self.restores,
            self.restored_tokens,
            self.pages_from_store,
        )

    # -- spill (inside the tree's eviction) ----------------------------------------------------
    def spill(self, hashes: list[int], rows: Sequence[list[int] | None]) -> None:
        """Keep these tree pages before the tree frees them: ``rows[g]``, KV group g's physical
        pages in logical order (None: a tombstone in that window group, whose layers' KV is then
        not kept; ``HostPage.live`` says which groups' KV a page keeps)."""
        layer_group = self.kv.layer_group
        live = tuple(row is not None for row in rows)
        # each layer's pages in its tensors (``PagedKVCache.physical``)
        physical = [
            None if (row := rows[layer_group[i]]) is None else self.kv.physical(i, row)
            for i in range(self.kv.layout.num_layers)
        ]
        for j, h in enumerate(hashes):
            layers: list[tuple[torch.Tensor, torch.Tensor] | None] = []
            nbytes = 0
            for i in range(self.kv.layout.num_layers):
                row = physical[i]
                if row is None:
                    layers.append(None)
                    continue
                layer = self.kv.layer(i)
                k, v = layer.k[row[j]].to("cpu", copy=True), layer.v[row[j]].to("cpu", copy=True)
                layers.append((k, v))
                nbytes += k.nbytes + v.nbytes
            page = HostPage(tuple(layers), nbytes, live)
            self._put(h, page)
            if self.store is not None and self.store_policy == "write_through":
                self.store.write([(h, page)])

    def _put(self, h: int, page: HostPage) -> None:
        old = self._pages.pop(h, None)
        if old is not None:
            self.used_bytes -= old.nbytes
        if page.nbytes > self.capacity_bytes:
            return
        self._pages[h] = page
        self.used_bytes += page.nbytes
        self.spilled_pages += 1
        while self.used_bytes > self.capacity_bytes:
            gone_hash, gone = self._pages.popitem(last=False)
            self.used_bytes -= gone.nbytes
            self.evicted_pages += 1
            if self.store is not None and self.store_policy == "host_evict":
                self.store.write([(gone_hash, gone)])

    def absorb(self, pages: list[tuple[int, HostPage]]) -> None:
        """Pages a store fetch brought (already in the store: not written back)."""
        for h, page in pages:
            self._put(h, page)
        self.pages_from_store += len(pages)

    def estimate_nbytes(self, num_pages: int) -> int:
        """Bytes of ``num_pages`` consecutive pages ending at a restore point, per KV group: every
        page of a full-attention group, a window group's only for the pages of its window before
        the end."""
        p, esize = self.page_size, self.kv.layer(0).k.element_size()
        total = 0
        for g in self.kv.groups:
            spec, need = g.spec, g.spec.window_tokens
            pages = num_pages if need is None else min(num_pages, -(-need // p) + 1)
            total += pages * p * g.num_layers * spec.kv_heads * (spec.head_dim + spec.v_head_dim) * esize
        return total

    # -- restore (at admission) ----------------------------------------------------------------
    def extent(
        self,
        hashes: list[int],
        first_page: int,
        fetched: dict[int, HostPage] | None = None,
    ) -> int:
        """The longest boundary b (in pages) > ``first_page`` with pages [first_page, b) here (or in
        ``fetched``: a store fetch's pages, which this tier may be too small to hold at once) and,
        for each window group, its KV of the pages covering its W-1 tokens before b*page too (the
        pages below ``first_page`` are the tree hit's, whose windows are live); ``first_page``
        when none."""
        p = self.page_size
        windows = [g for g, grp in enumerate(self.kv.groups) if grp.spec.is_sliding]
        need = [self.kv.groups[g].spec.window_tokens or 0 for g in windows]
        best = first_page
        runs = [0] * len(windows)  # per window group: tokens of consecutive kept pages ending at b
        for j in range(first_page, len(hashes)):
            page = self._page(hashes[j], fetched)
            if page is None:
                break
            runs = [r + p if page.live[g] else 0 for r, g in zip(runs, windows, strict=True)]
            if groups_accept(runs, (j + 1 - first_page) * p, need):
                best = j + 1
        return best

    def _page(self, h: int, fetched: dict[int, HostPage] | None) -> HostPage | None:
        page = fetched.get(h) if fetched else None
        return page if page is not None else self._pages.get(h)

    def restore(
        self, hashes: list[int], first_page: int, end_page: int, fetched: dict[int, HostPage] | None = None
    ) -> HostRestore:
        pages = []
        for j in range(first_page, end_page):
            if hashes[j] in self._pages:
                self._pages.move_to_end(hashes[j])
            page = self._page(hashes[j], fetched)
            assert page is not None, "restore() covers what extent() found"
            pages.append(page)
        self.restores += 1
        p = self.page_size
        return HostRestore(first_page * p, end_page * p, tuple(pages), p, self)

    def nbytes(
        self, hashes: list[int], first_page: int, end_page: int, fetched: dict[int, HostPage] | None = None
    ) -> int:
        total = 0
        for j in range(first_page, end_page):
            page = self._page(hashes[j], fetched)
            assert page is not None, "nbytes() covers what extent() found"
            total += page.nbytes
        return total
