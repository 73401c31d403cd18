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
import time
from typing import NamedTuple

import torch

from llm_core.caches.kv_pool import DualKVCache


class HostPage(NamedTuple):
    layers: tuple[
        tuple[torch.Tensor, torch.Tensor] | None, ...
    ]  # per layer K [page, H, D], V; None: not kept
    nbytes: int
    has_swa: bool  # the SWA layers' KV is here (the page was live in the window when spilled)


class FetchCostModel:
    """Copy back only when it is faster than computing: both rates measured, smoothed (EWMA)."""

    def __init__(
        self, copy_bytes_per_s: float = 2e9, prefill_tokens_per_s: float = 1e3, alpha: float = 0.2
    ) -> None:
        # Priors until the first measurements: a slow prefill, a modest copy (both get replaced).
        self.copy_bytes_per_s = copy_bytes_per_s
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.alpha = alpha

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            self.copy_bytes_per_s += self.alpha * (nbytes / seconds - self.copy_bytes_per_s)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            self.prefill_tokens_per_s += self.alpha * (tokens / seconds - self.prefill_tokens_per_s)

    def fetch_is_faster(self, nbytes: int, tokens: int) -> bool:
        return nbytes / self.copy_bytes_per_s < tokens / self.prefill_tokens_per_s


class HostRestore(NamedTuple):
    """A ``KVSource``: positions [start, end) copied from host pages (held here, so the tier may
    evict them meanwhile)."""

    start: int
    end: int
    pages: tuple[HostPage, ...]  # logical pages start // page .. end // page - 1
    page_size: int
    tier: HostKVTier

    @property
    def first_token(self) -> int | None:
        return None

    def write(self, kv: DualKVCache, full_pages: list[int], swa_pages: list[int], lo: int, hi: int) -> None:
        t0 = time.perf_counter()
        p, first = self.page_size, self.start // self.page_size
        nbytes = 0
        for j in range(lo // p, (hi - 1) // p + 1):
            page = self.pages[j - first]
            r0, r1 = max(lo, j * p) - j * p, min(hi, (j + 1) * p) - j * p
            for i, kv_i in enumerate(page.layers):
                if kv_i is None:
                    continue  # an SWA layer below the window: never read, dropped after the copy
                layer = kv.layer(i)
                phys = (swa_pages if layer.is_swa else full_pages)[j]
                layer.k[phys, r0:r1] = kv_i[0][r0:r1]
                layer.v[phys, r0:r1] = kv_i[1][r0:r1]
            nbytes += page.nbytes * (r1 - r0) // p
        self.tier.restored_tokens += hi - lo
        self.tier.cost.observe_copy(nbytes, time.perf_counter() - t0)


class HostKVTier:
    def __init__(self, kv: DualKVCache, capacity_bytes: int) -> None:
        self.kv = kv
        self.page_size = kv.page_size
        self.capacity_bytes = capacity_bytes
        self.cost = FetchCostModel()
        self._pages: collections.OrderedDict[int, HostPage] = collections.OrderedDict()
        self.used_bytes = 0
        self.spilled_pages = 0
        self.evicted_pages = 0
        self.restores = 0
        self.restored_tokens = 0

    def __len__(self) -> int:
        return len(self._pages)

    # -- spill (inside the tree's eviction) ----------------------------------------------------
    def spill(self, hashes: list[int], full_pages: list[int], swa_pages: list[int] | None) -> None:
        """Keep these tree pages (logical order, their physical ids; ``swa_pages`` None: a
        tombstone, full KV only) before the tree frees them."""
        for j, h in enumerate(hashes):
            layers: list[tuple[torch.Tensor, torch.Tensor] | None] = []
            nbytes = 0
            for i in range(self.kv.layout.num_layers):
                layer = self.kv.layer(i)
                if layer.is_swa and swa_pages is None:
                    layers.append(None)
                    continue
                phys = (swa_pages if layer.is_swa else full_pages)[j]  # type: ignore[index]
                k, v = layer.k[phys].to("cpu", copy=True), layer.v[phys].to("cpu", copy=True)
                layers.append((k, v))
                nbytes += k.nbytes + v.nbytes
            self._put(h, HostPage(tuple(layers), nbytes, swa_pages is not None))

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
            _, gone = self._pages.popitem(last=False)
            self.used_bytes -= gone.nbytes
            self.evicted_pages += 1

    # -- restore (at admission) ----------------------------------------------------------------
    def extent(self, hashes: list[int], first_page: int, window_tokens: int) -> int:
        """The longest boundary b (in pages) > ``first_page`` with pages [first_page, b) here and
        the SWA KV of the pages covering [b*page - window_tokens, b*page) here too (the pages below
        ``first_page`` are the tree hit's, whose window is live); ``first_page`` when none."""
        p = self.page_size
        best = first_page
        run = 0  # tokens of consecutive SWA-kept pages ending at the boundary
        for j in range(first_page, len(hashes)):
            page = self._pages.get(hashes[j])
            if page is None:
                break
            run = run + p if page.has_swa else 0
            b = (j + 1) * p
            if run >= min(window_tokens, b - first_page * p):
                best = j + 1
        return best

    def restore(self, hashes: list[int], first_page: int, end_page: int) -> HostRestore:
        pages = []
        for j in range(first_page, end_page):
            self._pages.move_to_end(hashes[j])
            pages.append(self._pages[hashes[j]])
        self.restores += 1
        p = self.page_size
        return HostRestore(first_page * p, end_page * p, tuple(pages), p, self)

    def nbytes(self, hashes: list[int], first_page: int, end_page: int) -> int:
        return sum(self._pages[hashes[j]].nbytes for j in range(first_page, end_page))
