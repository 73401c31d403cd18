"""KV manager: page tables of running sequences over the two pools, with the radix prefix cache.

Life of a sequence's KV (all through this class; the scheduler decides *when*):

    admit    match_prefix(seq)      hit pages borrowed from the tree (locked), num_computed = hit
    step     allocate(seq, n)       pages for positions [c, c+n) in both pools (evicting cache if short)
    after    commit(seq, n)         num_computed += n; SWA pages no future query can see are dropped
    finish   release(seq)           computed whole pages inserted into the tree, then unlocked

The SWA pool holds only what some future query can read. After ``c`` tokens are computed the
next query is at position c and reads keys from c-W+1; pages below the window of the last page
boundary ``b = c // page * page`` are dropped (so a request resuming at ``b`` from the prefix
cache still finds its window)::

    positions  0 ......... b-W+1 ...... b .. c      (W = sliding_window, counts the query)
    SWA pages  [ dropped  |  resident: window     ] a step computing [c, c+n) also needs [c, c+n)

Branch points: when a new sequence matches the tree further (full KV) than it can use (the SWA
window before that point was dropped), it recomputes up to there anyway. It then keeps
(*pins*) the SWA pages of the window before that point until it finishes, so its insert heals
the tombstone and the next sequence through the same branch point gets the hit. This is what
makes a shared system prompt hittable: the first sequence moved on past it, the second one
pins it. A pin is dropped when the sequence's own allocation would not fit otherwise.

The manager knows nothing of scheduling policy or of tensors; ``check_integrity`` proves that
every used page has exactly one owner (the tree, or one sequence) and that lock counts match the
sequences holding hits.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import NamedTuple

from llm_core.caches.host_restore import HostPage
from llm_core.caches.host_tier import HostKVTier
from llm_core.caches.kv_pool import PagePool, swa_pages_per_sequence
from llm_core.caches.kv_store_tier import FETCH_SPENT, StoreFetch
from llm_core.caches.page_hash import page_hashes
from llm_core.caches.radix_cache import InsertResult, RadixCache, RadixNode
from llm_core.serving.sequence import NOT_RESIDENT, Sequence


class PageNeed(NamedTuple):
    full: int
    swa: int


class KVManager:
    """Allocation for sequences over the full and SWA pools, with an optional prefix cache.

    ``swa_aware=False`` keeps every SWA page of a sequence (a cache that must keep all SWA KV):
    the baseline for ``bench.prefix_reuse`` and ``bench.kv_capacity``.
    """

    def __init__(
        self,
        full_pool: PagePool,
        swa_pool: PagePool,
        sliding_window: int,
        *,
        enable_prefix_cache: bool = True,
        swa_aware: bool = True,
        record_events: bool = False,
        host_tier: HostKVTier | None = None,
    ) -> None:
        """``host_tier``: where the prefix cache's evicted pages go, and come back from."""
        assert full_pool.page_size == swa_pool.page_size
        self.full_pool = full_pool
        self.swa_pool = swa_pool
        self.page_size = full_pool.page_size
        self.sliding_window = sliding_window
        self.swa_aware = swa_aware
        self.radix: RadixCache | None = None
        self.host_tier = host_tier if enable_prefix_cache and swa_aware else None
        # Positions below the next query whose window is kept as well (speculative decoding: the
        # MTP heads' queries trail the target's by up to k + 1 positions).
        self.swa_extra_tokens = 0
        # Speculative decoding: a prefix hit backs off to the previous hit point (see match_prefix).
        self.mtp_backoff = False
        self._peeks: weakref.WeakKeyDictionary[Sequence, tuple[tuple[int, int], int]] = (
            weakref.WeakKeyDictionary()
        )
        if enable_prefix_cache:
            self.radix = RadixCache(
                self.page_size,
                sliding_window,
                full_pool.free,
                swa_pool.free,
                swa_aware=swa_aware,
                record_events=record_events,
                on_delete=self._spill if self.host_tier is not None else None,
            )

    # ---- geometry ------------------------------------------------------------------------
    def first_live_swa_page(self, num_computed: int) -> int:
        """Lowest logical SWA page any query at position >= ``num_computed`` can read."""
        if not self.swa_aware:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.page_size

    def pages_needed(self, seq: Sequence, n: int) -> PageNeed:
        """New pages of each pool that computing the next ``n`` tokens of ``seq`` takes.

        Both rows always have one entry per logical page, and every SWA entry from the window start
        on is resident (``check_integrity`` verifies it), so both pools need one page per new
        logical page.
        """
        new = max(0, math.ceil((seq.num_computed_tokens + n) / self.page_size) - len(seq.full_pages))
        return PageNeed(new, new)

    # ---- prefix cache --------------------------------------------------------------------
    def peek_prefix(self, seq: Sequence) -> int:
        """Tokens a prefix match would give ``seq`` now (no lock, no LRU touch).

        Cached per sequence until the tree changes: the scheduler asks for every waiting sequence
        on every step it can admit.
        """
        if self.radix is None:
            return 0
        stamp = (self.radix.version, seq.num_tokens)
        cached = self._peeks.get(seq)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        hit = self.radix.match_prefix(seq.cache_keys, seq.num_tokens - 1, touch=False).length
        self._peeks[seq] = (stamp, hit)
        return hit

    def match_prefix(self, seq: Sequence) -> int | None:
        """Borrow (and lock) the cached prefix for a sequence that holds no pages yet; returns its
        length, or None (nothing borrowed) while the store tier fetches the prompt's next pages:
        ask again on a later step.

        At least one token is always left to compute: the step that computes it makes the logits.
        """
        assert not seq.full_pages and seq.prefix_lock is None and seq.num_computed_tokens == 0
        if self.radix is None:
            return 0
        hit = self.radix.match_prefix(seq.cache_keys, seq.num_tokens - 1)
        if self.mtp_backoff and hit.length:
            # The MTP heads' KV at a cached prefix's last positions was computed from tokens past
            # it (layer j at i reads token i + j + 1): resume from the previous hit point instead,
            # so the target recomputes that part and the heads with it (``speculative.py``).
            hit = self.radix.match_prefix(seq.cache_keys, hit.length - 1)
        fetched: dict[int, HostPage] = {}
        if self.host_tier is not None and self.host_tier.store is not None:
            waiting, fetched = self._await_store(seq, hit.length)
            if waiting:
                return None
        seq.prefix_lock = self.radix.lock(hit.node)
        seq.full_pages = list(hit.full_pages)
        seq.swa_pages = list(hit.swa_pages)
        seq.num_borrowed_pages = len(hit.full_pages)
        seq.num_swa_released = self.first_live_swa_page(hit.length)
        seq.num_computed_tokens = hit.length
        seq.num_cached_tokens = hit.length
        if self.swa_aware and hit.key_length > hit.length and self._can_pin():
            seq.swa_pin_end = hit.key_length
        if self.host_tier is not None:
            self._restore_from_host(seq, hit.length, fetched)
        self.pin_prompt_end(seq)
        return hit.length

    def _spill(self, node: RadixNode) -> None:
        assert self.host_tier is not None
        self.host_tier.spill(node.page_hashes, node.full_pages, node.swa_pages)

    def _await_store(self, seq: Sequence, hit: int) -> tuple[bool, dict[int, HostPage]]:
        """(whether ``seq`` must wait for the store, the pages a settled fetch brought). It waits
        while its fetch runs, or when one starts now: the tree and the host tier end short of the
        prompt and the cost model says fetching the rest beats computing it. A settled fetch's
        pages also join the host tier; a sequence asks the store once."""
        host = self.host_tier
        assert host is not None and host.store is not None
        store, f = host.store, seq.kv_fetch
        if f is FETCH_SPENT:
            return False, {}
        now = store.clock()
        if isinstance(f, StoreFetch):
            if not f.settled(now):
                return True, {}
            seq.kv_fetch = FETCH_SPENT
            if not f.done.is_set():
                store.abandon(f)  # slower than recomputing would have been: recompute
                return False, {}
            host.absorb(f.pages)
            return False, dict(f.pages)
        seq.kv_fetch = FETCH_SPENT
        p = self.page_size
        usable, first = (seq.num_tokens - 1) // p, hit // p
        if usable <= first:
            return False, {}
        hashes = page_hashes(seq.cache_keys[: usable * p], p)
        start = host.extent(hashes, first, self.sliding_window - 1) if len(host) else first
        if start >= usable:
            return False, {}
        n = usable - start
        recompute_s = n * p / host.cost.prefill_tokens_per_s
        if not store.worth_fetching(n, host.estimate_nbytes(n, self.sliding_window - 1), recompute_s):
            return False, {}
        seq.kv_fetch = store.fetch(hashes[start:usable], deadline=now + max(recompute_s, store.min_wait_s))
        return True, {}

    def _restore_from_host(self, seq: Sequence, hit: int, fetched: dict[int, HostPage]) -> None:
        """Past the tree's hit, the host tier (and a store fetch's ``fetched`` pages) may hold the
        next pages: plan them as a copy (``seq.kv_source``) when the cost model says a copy beats
        computing them (fetched pages are copied: the fetch was already judged worth it)."""
        host = self.host_tier
        assert host is not None
        p = self.page_size
        usable = (seq.num_tokens - 1) // p  # pages a hit may cover (one token is always computed)
        first = hit // p
        if usable <= first or not (len(host) or fetched):
            return
        hashes = page_hashes(seq.cache_keys[: usable * p], p)
        end = host.extent(hashes, first, self.sliding_window - 1, fetched)
        if end > first and (
            fetched or host.cost.fetch_is_faster(host.nbytes(hashes, first, end, fetched), (end - first) * p)
        ):
            seq.kv_source = host.restore(hashes, first, end, fetched)
            if seq.swa_pin_end and seq.swa_pin_end <= end * p:
                # The branch point lies in the copied range, where SWA pages below the copy's own
                # window are never written: keeping them would cache unwritten KV as live.
                seq.swa_pin_end = 0

    def pin_prompt_end(self, seq: Sequence, end: int | None = None) -> None:
        """Keep the SWA window of the prompt's last page boundary until release, so the tree
        learns a hit there: a repeat of the prompt, or the conversation's next turn (which re-sends
        this prompt, and a reply that rarely re-tokenizes to the ids generated), resumes at the
        prompt's end instead of where the decode's moving window left off. The boundary is the
        last one a repeat can use (a hit always leaves one token to compute). ``end``: another
        boundary (an imported prompt pins the one whose window its payload holds)."""
        if not self.swa_aware or not self._can_pin():
            return
        if end is None:
            end = (seq.num_prompt_tokens - 1) // self.page_size * self.page_size
        if end > max(seq.num_computed_tokens, seq.swa_pin_end):
            seq.swa_prompt_pin = end

    def _can_pin(self) -> bool:
        # Pinning holds up to one extra window per sequence; only where the pool has room to spare
        # (allocate() drops a sequence's pin anyway when its own pages would not fit).
        return self.swa_pool.num_pages >= 4 * swa_pages_per_sequence(self.sliding_window, self.page_size)

    # ---- allocation ----------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, n: int) -> bool:
        need = self.pages_needed(seq, n)
        return self._available(need)

    def _available(self, need: PageNeed) -> bool:
        full_ok = need.full <= self.full_pool.num_free
        swa_ok = need.swa <= self.swa_pool.num_free
        if full_ok and swa_ok:
            return True
        if self.radix is None:
            return False
        # Evicting full KV from the tree also frees the SWA KV of those nodes, but not the other way
        # round; the SWA bound below counts what SWA eviction alone can free.
        full_ok = full_ok or need.full <= self.full_pool.num_free + self.radix.evictable_full_pages()
        swa_ok = swa_ok or need.swa <= self.swa_pool.num_free + self.radix.evictable_swa_pages()
        return full_ok and swa_ok

    def allocate(self, seq: Sequence, n: int) -> bool:
        """Give ``seq`` pages for positions [c, c+n); evicts cached KV when a pool is short.

        Returns False, taking nothing, when the pools cannot hold it even after eviction.
        """
        if seq.num_computed_tokens + n <= len(seq.full_pages) * self.page_size:
            return True  # the pages held already cover them (most decode steps): nothing to take
        need = self.pages_needed(seq, n)
        if not self._available(need) and not (self.unpin(seq) and self._available(need)):
            return False
        if self.radix is not None:
            if need.full > self.full_pool.num_free:
                self.radix.evict_full(need.full - self.full_pool.num_free)
            if need.swa > self.swa_pool.num_free:
                self.radix.evict_swa(need.swa - self.swa_pool.num_free)
        full = self.full_pool.alloc(need.full)
        swa = self.swa_pool.alloc(need.swa)
        if full is None or swa is None:  # pragma: no cover - _available() guarantees room
            self.full_pool.free(full or [])
            self.swa_pool.free(swa or [])
            return False
        seq.full_pages.extend(full)
        seq.swa_pages.extend(swa)
        return True

    def commit(self, seq: Sequence, n: int) -> None:
        """Record that ``n`` more tokens of ``seq`` have KV; drop SWA pages that left every window."""
        seq.num_computed_tokens += n
        assert seq.num_computed_tokens <= len(seq.full_pages) * self.page_size
        self.free_out_of_window(seq)

    def free_out_of_window(self, seq: Sequence) -> int:
        """Drop SWA pages below the window of the last page boundary; returns how many were freed.

        The window kept is that of ``b = c // page * page`` rather than of ``c`` itself: ``b`` is
        where a later request can resume from this sequence's cached pages, and its window
        [b-W+1, b) reaches at most one page below c's. It costs nothing at the peak: a decode step
        still holds at most ``swa_pages_per_sequence`` pages (the next page is not needed until
        c reaches it, and then b moves with it).
        """
        b = seq.num_computed_tokens // self.page_size * self.page_size
        lo = self.first_live_swa_page(min(b, max(0, seq.num_computed_tokens - self.swa_extra_tokens)))
        if lo <= seq.num_swa_released:
            return 0  # the window start did not pass a page since the last call (most steps)
        pins = self._pinned_pages(seq)
        freed: list[int] = []
        for i in range(seq.num_swa_released, min(lo, len(seq.swa_pages))):
            if any(pin_lo <= i < pin_hi for pin_lo, pin_hi in pins):
                continue
            page = seq.swa_pages[i]
            if page != NOT_RESIDENT and i >= seq.num_borrowed_pages:
                freed.append(page)  # borrowed pages belong to the tree: just stop referencing them
            seq.swa_pages[i] = NOT_RESIDENT
        seq.num_swa_released = max(seq.num_swa_released, lo)
        self.swa_pool.free(freed)
        return len(freed)

    def _pinned_pages(self, seq: Sequence) -> list[tuple[int, int]]:
        """Logical SWA pages [lo, hi) kept for the branch point ``seq.swa_pin_end`` and the prompt's
        end ``seq.swa_prompt_pin`` (none when unpinned)."""
        return [
            (self.first_live_swa_page(end), end // self.page_size)
            for end in (seq.swa_pin_end, seq.swa_prompt_pin)
            if end
        ]

    def unpin(self, seq: Sequence) -> bool:
        """Drop ``seq``'s pinned windows (the pages it already moved past); True if any."""
        pins = self._pinned_pages(seq)
        if not pins:
            return False
        seq.swa_pin_end = seq.swa_prompt_pin = 0
        freed = []
        moved = False
        for pin_lo, pin_hi in pins:
            upto = min(pin_hi, seq.num_swa_released)
            moved = moved or upto > pin_lo
            for i in range(pin_lo, upto):
                page = seq.swa_pages[i]
                if page != NOT_RESIDENT and i >= seq.num_borrowed_pages:
                    freed.append(page)
                seq.swa_pages[i] = NOT_RESIDENT
        self.swa_pool.free(freed)
        return bool(freed) or moved

    # ---- release -------------------------------------------------------------------------
    def release(self, seq: Sequence, cache: bool = True) -> None:
        """Give back all of ``seq``'s KV: computed whole pages into the prefix cache, the rest freed.

        Used at finish, abort and preemption; afterwards ``seq`` holds no pages and no lock.
        """
        nb = seq.num_borrowed_pages
        # A half-copied import holds SWA pages whose positions were never written: never cached.
        cache = cache and not seq.copying_kv
        if self.radix is not None and cache:
            computed = seq.num_computed_tokens
            if seq.cacheable_tokens is not None:
                computed = min(computed, seq.cacheable_tokens)
            n = computed // self.page_size
            key = seq.cache_keys[: n * self.page_size]
            tokens = seq.token_slice(0, n * self.page_size) if self.radix.record_events else None
            res: InsertResult = self.radix.insert(key, seq.full_pages[:n], seq.swa_pages[:n], tokens)
            self.full_pool.free(res.full_to_free)
            self.swa_pool.free(res.swa_to_free)
            self.full_pool.free(seq.full_pages[n:])
            self.swa_pool.free(seq.swa_pages[n:])
        else:
            self.full_pool.free(seq.full_pages[nb:])
            self.swa_pool.free(seq.swa_pages[nb:])
        if seq.prefix_lock is not None:
            assert self.radix is not None
            self.radix.unlock(seq.prefix_lock)
        if seq.kv_source is not None and seq.kv_source.first_token is None:
            seq.kv_source = None  # a restore (not an import): the next admission matches anew
        seq.full_pages = []
        seq.swa_pages = []
        seq.num_borrowed_pages = 0
        seq.num_swa_released = 0
        seq.swa_pin_end = seq.swa_prompt_pin = 0
        seq.prefix_lock = None

    # ---- accounting ----------------------------------------------------------------------
    def evictable_pages(self) -> PageNeed:
        if self.radix is None:
            return PageNeed(0, 0)
        return PageNeed(self.radix.evictable_full_pages(), self.radix.evictable_swa_pages())

    def check_integrity(self, seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError unless every used page has exactly one owner and locks match holders.

        ``seqs`` must be every sequence that holds pages (running ones).
        """
        self.full_pool.check_integrity()
        self.swa_pool.check_integrity()
        seqs = list(seqs)
        full_owned: list[int] = []
        swa_owned: list[int] = []
        tree_full: set[int] = set()
        tree_swa: set[int] = set()
        if self.radix is not None:
            self.radix.check_integrity([s.prefix_lock for s in seqs if s.prefix_lock is not None])
            full_owned.extend(self.radix.full_pages_held())
            swa_owned.extend(self.radix.swa_pages_held())
            tree_full, tree_swa = set(full_owned), set(swa_owned)
        for s in seqs:
            nb = s.num_borrowed_pages
            if len(s.full_pages) < math.ceil(s.num_computed_tokens / self.page_size):
                raise AssertionError(f"seq {s.seq_id}: computed tokens without full pages")
            borrowed_swa = [p for p in s.swa_pages[:nb] if p != NOT_RESIDENT]
            if not tree_full.issuperset(s.full_pages[:nb]) or not tree_swa.issuperset(borrowed_swa):
                raise AssertionError(f"seq {s.seq_id}: borrowed pages are not in the prefix cache")
            full_owned.extend(s.full_pages[nb:])
            swa_owned.extend(p for p in s.swa_pages[nb:] if p != NOT_RESIDENT)
            if len(s.swa_pages) != len(s.full_pages):
                raise AssertionError(f"seq {s.seq_id}: page rows of different lengths")
            lo = self.first_live_swa_page(s.num_computed_tokens)
            if NOT_RESIDENT in s.swa_pages[lo:]:
                raise AssertionError(f"seq {s.seq_id}: a SWA page of the live window is missing")
        for name, owned, pool in (("full", full_owned, self.full_pool), ("swa", swa_owned, self.swa_pool)):
            if len(owned) != len(set(owned)):
                raise AssertionError(f"{name}: a page has two owners")
            if set(owned) != pool.used_pages():
                raise AssertionError(
                    f"{name}: owned pages ({len(owned)}) differ from used pages ({pool.num_used}): leak or stray"
                )
