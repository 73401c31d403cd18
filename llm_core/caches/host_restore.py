"""What the host tier hands a request: pages kept in host memory, and the copy that writes them into
the request's pool pages (a ``KVSource``, ``caches/kv_source.py``), timed for the cost model.

    HostPage      one logical page: K and V per layer ([page, heads, dim] each; None for a
                  window layer whose KV was not kept), its bytes, which groups' KV is there
    HostRestore   positions [start, end) of one sequence from a run of such pages
    FetchCostModel  measured copy bandwidth against measured prefill throughput: copy or compute
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from llm_core.caches.kv_pool import PagedKVCache, PageRows


class RestoreCounters(Protocol):
    """Where a restore reports what it copied (the host tier)."""

    restored_tokens: int
    cost: FetchCostModel


class HostPage(NamedTuple):
    layers: tuple[
        tuple[torch.Tensor, torch.Tensor] | None, ...
    ]  # per layer K [page, H, D], V; None: not kept
    nbytes: int
    live: tuple[bool, ...]  # per KV group: its layers' KV is here (live in its window when spilled)


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


@dataclass(eq=False)
class HostRestore:
    """A ``KVSource``: positions [start, end) copied from host pages (held here, so the tier may
    evict them meanwhile).

    The copy is timed for the cost model once per chunk: ``write_layer`` adds up the seconds of its
    own calls (a copy beside the forward interleaves other sequences' layers between them, which
    are not this chunk's time) and reports bytes, seconds and tokens at the chunk's last layer."""

    start: int
    end: int
    pages: tuple[HostPage, ...]  # logical pages start // page .. end // page - 1
    page_size: int
    tier: RestoreCounters
    _chunk_seconds: float = field(default=0.0, init=False, repr=False)  # this chunk's layers so far

    @property
    def first_token(self) -> int | None:
        return None

    def write(self, kv: PagedKVCache, rows: PageRows, lo: int, hi: int) -> None:
        for i in range(kv.num_layers):
            self.write_layer(kv, i, rows, lo, hi)

    def write_layer(self, kv: PagedKVCache, layer: int, rows: PageRows, lo: int, hi: int) -> None:
        t0 = time.perf_counter()
        if layer == 0:
            self._chunk_seconds = 0.0
        p, first = self.page_size, self.start // self.page_size
        dst = kv.layer_storage(layer)
        row = kv.physical(layer, rows[kv.layer_group[layer]])  # this layer's pages in its tensors
        whole_rows: list[int] = []  # physical pages of the logical pages the chunk covers entirely
        whole_kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # their K, V [page, H, D]
        for j in range(lo // p, (hi - 1) // p + 1):
            kv_j = self.pages[j - first].layers[layer]  # K, V [page, H, D] of logical page j
            if kv_j is None:
                continue  # a window layer below its window: never read, dropped after the copy
            r0, r1 = max(lo, j * p) - j * p, min(hi, (j + 1) * p) - j * p
            if r1 - r0 == p:
                whole_rows.append(row[j])
                whole_kv.append(kv_j)
            else:  # a page the chunk cuts (its first or last): the slots it covers
                dst.k[row[j], r0:r1] = kv_j[0][r0:r1]
                dst.v[row[j], r0:r1] = kv_j[1][r0:r1]
        if whole_kv:
            # One stack and one scatter of whole pages per tensor instead of a copy per page (a
            # chunk of 8K tokens is ~500 pages a layer): [m, page, H, D] into pool pages ``idx``.
            idx = torch.tensor(whole_rows, dtype=torch.int64, device=dst.k.device)
            for t, dst_t in ((0, dst.k), (1, dst.v)):
                src = torch.stack([kv_j[t] for kv_j in whole_kv])
                dst_t.index_copy_(0, idx, src.to(dst_t.device, dst_t.dtype))
        self._chunk_seconds += time.perf_counter() - t0
        if layer == kv.num_layers - 1:  # the chunk is complete: account it once
            nbytes = 0
            for j in range(lo // p, (hi - 1) // p + 1):
                r0, r1 = max(lo, j * p), min(hi, (j + 1) * p)
                nbytes += self.pages[j - first].nbytes * (r1 - r0) // p
            self.tier.restored_tokens += hi - lo
            self.tier.cost.observe_copy(nbytes, self._chunk_seconds)
