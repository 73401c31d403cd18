"""The store tier below the host tier: KV pages in Redis / Valkey (or a directory) that every engine
sharing the store can fetch, so a session can return to another engine, node or restart.

    host tier spills or drops a page ──write (queued)──▶ writer thread: encode ──put──▶ store
        key  epd:kv/<model>/<page hash, 16 hex>   value  ``kv_page_codec`` bytes (crc32 checked)
    admission: the tree and the host tier end short of the prompt ──fetch──▶ fetcher thread:
        get in batches from the first missing page, stop at the first miss or bad value
        ──▶ ``StoreFetch`` done (the engine is woken) ──▶ the pages join the host tier, whose
        extent / restore turn them into a copy like any host page

The engine thread never waits on the store: a sequence whose pages are being fetched stays in the
waiting queue (the others run) until its fetch is done or its deadline passes (then it recomputes:
the fetch is abandoned). Whether to fetch at all is a cost call: the estimated fetch time (a
measured round trip plus bytes over measured bandwidth) against the measured prefill time of
the same tokens; a store that looked slow is tried again after ``probe_interval_s``. A value that
fails its checks is deleted (the recompute's spill writes it again). Writes are best effort: a
queue over ``max_pending_bytes`` drops the newest pages (counted); a store that is down is the
``GuardedStore``'s business (calls answer misses at once).

``model`` in the key names the weights, KV layout, dtype and page size (``model_kv_id``), so
engines of other models sharing the store never read each other's pages.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import torch

from epd_common.store.store import Store
from llm_core.caches.host_restore import HostPage
from llm_core.caches.kv_page_codec import PageCodecError, decode, dtype_name, encode
from llm_core.caches.kv_pool import KVLayout

log = logging.getLogger("epd.llm.kv_store")

# a request's store fetch (KVTransfers.fetch) once it settled (or was not worth it): it asks once
FETCH_SPENT = "spent"
KEY_PREFIX = "epd:kv/"


def model_kv_id(model_dir: Path | None, layout: KVLayout, dtype: torch.dtype, page_size: int) -> str:
    """16 hex digits naming what a KV page depends on: the weights (config.json and the content of
    every weight file: a Hugging Face cache's blob name where the file is a link to one, else the
    file's bytes), the KV layout, dtype and page size. ``model_dir`` None: the embedded default,
    named by its layout (it is generated deterministically)."""
    h = hashlib.sha256(repr((layout, dtype_name(dtype), page_size)).encode())
    if model_dir is not None:
        h.update((model_dir / "config.json").read_bytes())
        for f in sorted(model_dir.glob("*.safetensors")):
            h.update(f.name.encode())
            target = f.resolve()
            if (
                f.is_symlink()
                and len(target.name) == 64
                and all(c in "0123456789abcdef" for c in target.name)
            ):
                h.update(target.name.encode())  # the hub's blob name is the file's sha256
                continue
            with open(target, "rb") as fh:
                while chunk := fh.read(16 << 20):
                    h.update(chunk)
    return h.hexdigest()[:16]


class StoreFetch:
    """One prompt's pages on their way from the store: filled by the fetcher thread, read by the
    engine thread once ``done`` is set (the pages in order from the first hash, up to a miss)."""

    def __init__(self, hashes: list[int], deadline: float) -> None:
        self.hashes = hashes
        self.deadline = deadline  # monotonic: past it, the sequence recomputes instead
        self.pages: list[tuple[int, HostPage]] = []
        self.done = threading.Event()
        self.cancelled = False

    def settled(self, now: float) -> bool:
        return self.done.is_set() or now >= self.deadline


class KVStoreCounters(NamedTuple):
    written_pages: int
    written_bytes: int
    dropped_pages: int  # not written: the queue was over its byte budget
    fetches: int
    fetched_pages: int
    fetched_bytes: int
    missed_fetches: int  # fetches whose first page was not there
    corrupt_pages: int  # values that failed their checks (deleted)
    timed_out_fetches: int  # abandoned at their deadline (recomputed)
    skipped_fetches: int  # not tried: the cost model said recomputing is faster
    bytes_per_s: float  # measured fetch bandwidth (EWMA)
    round_trip_s: float  # measured per-call latency (EWMA)


class KVStoreTier:
    def __init__(
        self,
        store: Store,
        model: str,
        layout: KVLayout,
        page_size: int,
        dtype: torch.dtype,
        *,
        ttl_s: float | None = None,
        max_pending_bytes: int = 256 << 20,
        batch_pages: int = 16,
        probe_interval_s: float = 10.0,
        min_wait_s: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``min_wait_s``: the least a sequence waits for its fetch (a prompt that recomputes in
        a millisecond still gets a round trip's chance)."""
        self.store = store
        self.model = model
        self.layout = layout
        self.page_size = page_size
        self.dtype = dtype
        self.ttl_s = ttl_s
        self.max_pending_bytes = max_pending_bytes
        self.batch_pages = batch_pages
        self.probe_interval_s = probe_interval_s
        self.min_wait_s = min_wait_s
        self.clock = clock
        self.on_ready: Callable[[], None] | None = None  # the engine's wake-up, after each fetch
        # Priors until measured: loopback Redis-like latency and bandwidth (replaced by EWMA).
        self.bytes_per_s = 200e6
        self.round_trip_s = 1e-3
        self._last_measured = -float("inf")
        self._known: collections.OrderedDict[int, None] = collections.OrderedDict()  # in the store
        self._cv = threading.Condition()
        self._writes: collections.deque[tuple[int, HostPage]] = collections.deque()
        self._pending_bytes = 0
        self._writing = 0
        self._fetches: collections.deque[StoreFetch] = collections.deque()
        self._closed = False
        self._n = collections.Counter[str]()
        self._threads = [
            threading.Thread(target=self._write_loop, name="epd-kv-store-writer", daemon=True),
            threading.Thread(target=self._fetch_loop, name="epd-kv-store-fetcher", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def key(self, page_hash: int) -> str:
        return f"{KEY_PREFIX}{self.model}/{page_hash:016x}"

    # -- write side (engine thread enqueues) ---------------------------------------------------
    def write(self, pages: Iterable[tuple[int, HostPage]]) -> None:
        """Queue pages for the store (pages it is known to hold already are skipped)."""
        with self._cv:
            for h, page in pages:
                if h in self._known:
                    continue
                if self._pending_bytes + page.nbytes > self.max_pending_bytes:
                    self._n["dropped_pages"] += 1
                    continue
                self._writes.append((h, page))
                self._pending_bytes += page.nbytes
            self._cv.notify_all()

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._writes and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                batch = [self._writes.popleft() for _ in range(min(self.batch_pages, len(self._writes)))]
                self._writing = len(batch)
            try:
                items = [(self.key(h), encode(page, h, self.model, self.page_size)) for h, page in batch]
                self.store.put(items, self.ttl_s)  # a GuardedStore: never raises, a failure is a miss later
                with self._cv:
                    for h, _ in batch:
                        self._remember(h)
                    self._n["written_pages"] += len(batch)
                    self._n["written_bytes"] += sum(len(v) for _, v in items)
            except Exception:
                log.exception("writing KV pages to the store failed; they will be recomputed when needed")
            finally:
                with self._cv:
                    self._pending_bytes -= sum(p.nbytes for _, p in batch)
                    self._writing = 0
                    self._cv.notify_all()

    def _remember(self, h: int) -> None:
        self._known[h] = None
        self._known.move_to_end(h)
        if len(self._known) > 1 << 20:
            self._known.popitem(last=False)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued page was written (tests, benchmarks, shutdown); False on timeout."""
        end = time.monotonic() + timeout_s
        with self._cv:
            while self._writes or self._writing:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    # -- read side -----------------------------------------------------------------------------
    def estimate_s(self, num_pages: int, nbytes: int) -> float:
        """Seconds a fetch of ``num_pages`` pages (``nbytes``) is expected to take: a round trip per
        batch plus the bytes at the measured bandwidth."""
        calls = -(-num_pages // self.batch_pages)
        return calls * self.round_trip_s + nbytes / self.bytes_per_s

    def worth_fetching(self, num_pages: int, nbytes: int, recompute_s: float) -> bool:
        """Fetch when it is estimated faster than recomputing, or when the estimate is stale (the
        store may have recovered from being slow)."""
        if self.clock() - self._last_measured > self.probe_interval_s:
            return True
        ok = self.estimate_s(num_pages, nbytes) < recompute_s
        if not ok:
            self._n["skipped_fetches"] += 1
        return ok

    def fetch(self, hashes: list[int], deadline: float) -> StoreFetch:
        f = StoreFetch(hashes, deadline)
        with self._cv:
            self._n["fetches"] += 1
            self._fetches.append(f)
            self._cv.notify_all()
        return f

    def abandon(self, f: StoreFetch) -> None:
        """The engine stopped waiting (deadline): the fetcher stops at its next batch."""
        f.cancelled = True
        self._n["timed_out_fetches"] += 1

    def _fetch_loop(self) -> None:
        while True:
            with self._cv:
                while not self._fetches and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                f = self._fetches.popleft()
            try:
                self._run_fetch(f)
            except Exception:
                log.exception("fetching KV pages from the store failed; the prompt is recomputed")
            finally:
                f.done.set()
                if self.on_ready is not None:
                    self.on_ready()

    def _run_fetch(self, f: StoreFetch) -> None:
        for i in range(0, len(f.hashes), self.batch_pages):
            if f.cancelled:
                return
            hashes = f.hashes[i : i + self.batch_pages]
            t0 = time.perf_counter()
            values = self.store.get([self.key(h) for h in hashes])
            got = sum(len(v) for v in values if v is not None)
            self._observe(got, time.perf_counter() - t0)
            for h, value in zip(hashes, values, strict=True):
                if value is None:
                    if not f.pages:
                        self._n["missed_fetches"] += 1
                    return
                try:
                    page = decode(value, h, self.model, self.layout, self.page_size, self.dtype)
                except PageCodecError as e:
                    log.warning("dropping KV page %016x from the store: %s", h, e)
                    self._n["corrupt_pages"] += 1
                    self.store.delete([self.key(h)])
                    with self._cv:
                        self._known.pop(h, None)
                    return
                f.pages.append((h, page))
                self._n["fetched_pages"] += 1
                self._n["fetched_bytes"] += len(value)
                with self._cv:
                    self._remember(h)

    def _observe(self, nbytes: int, seconds: float) -> None:
        alpha = 0.3
        self._last_measured = self.clock()
        if nbytes >= 256 * 1024 and seconds > 0:
            self.bytes_per_s += alpha * (nbytes / seconds - self.bytes_per_s)
        elif seconds > 0:
            self.round_trip_s += alpha * (seconds - self.round_trip_s)

    def counters(self) -> KVStoreCounters:
        n = self._n
        return KVStoreCounters(
            n["written_pages"],
            n["written_bytes"],
            n["dropped_pages"],
            n["fetches"],
            n["fetched_pages"],
            n["fetched_bytes"],
            n["missed_fetches"],
            n["corrupt_pages"],
            n["timed_out_fetches"],
            n["skipped_fetches"],
            self.bytes_per_s,
            self.round_trip_s,
        )

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=5.0)
