"""KV manager: page tables of running sequences over the KV groups' pools, with the radix prefix cache.

One group manager per KV group (``kv_group_manager.py``: full attention first, then each sliding
window); a sequence holds one page row per group, all of one length. A full-attention model has
one group and does no window bookkeeping at all.

Life of a sequence's KV (all through this class; the scheduler decides *when*):

    admit    match_prefix(seq)      hit pages borrowed from the tree (locked), num_computed = hit
    step     allocate(seq, n)       pages for positions [c, c+n) in every group (evicting cache if short)
    after    commit(seq, n)         num_computed += n; window pages no future query can see are dropped
    finish   release(seq)           computed whole pages inserted into the tree, then unlocked

A sliding-window group holds only what some future query can read (shown for one window W;
each window group does the same with its own). After ``c`` tokens are computed the next query is
at position c and reads keys from c-W+1; pages below the window of the last page boundary
``b = c // page * page`` are dropped (so a request resuming at ``b`` from the prefix cache still
finds its window)::

    positions     0 ......... b-W+1 ...... b .. c      (W counts the query)
    window pages  [ dropped  |  resident: window     ] a step computing [c, c+n) also needs [c, c+n)

Branch points: when a new sequence matches the tree further (full KV) than it can use (some
group's window before that point was dropped), it recomputes up to there anyway. It then keeps
(*pins*) each window group's pages of its window before that point until it finishes, so its insert heals
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

from llm_core.caches.host_tier import HostKVTier
from llm_core.caches.kv_connector import HostTierConnector, KVConnector, PromptImports, StoreTierConnector
from llm_core.caches.kv_group_manager import FullAttentionManager, GroupManager, SlidingWindowManager
from llm_core.caches.kv_pool import PagedKVCache
from llm_core.caches.kv_transfers import KVTransfers
from llm_core.caches.page_pool import PageAllocator, PagePool, check_blocks
from llm_core.caches.radix_cache import InsertResult, RadixCache, RadixNode
from llm_core.caches.seq_kv import NOT_RESIDENT, SeqKV
from llm_core.request import RequestId, Sequence

_EMPTY = SeqKV()  # what ``of`` reads for a sequence that holds nothing (never written)


class PageNeed(NamedTuple):
    """New pages of each group's pool (``per_group[g]``) that a step takes."""

    per_group: tuple[int, ...]

    @property
    def full(self) -> int:
        return self.per_group[0]


class KVManager:
    """Allocation for sequences over the KV groups' pools, with an optional prefix cache.

    ``groups``: one manager per KV group, full attention first (``kv_groups`` order).
    ``window_aware=False`` keeps every window page of a sequence (a cache that must keep all of a
    window group's KV): the baseline for ``bench.prefix_reuse`` and ``bench.kv_capacity``; it is
    applied to the sliding-window managers.
    """

    def __init__(
        self,
        groups: list[GroupManager],
        *,
        enable_prefix_cache: bool = True,
        window_aware: bool = True,
        record_events: bool = False,
        host_tier: HostKVTier | None = None,
    ) -> None:
        """``host_tier``: where the prefix cache's evicted pages go, and come back from."""
        assert groups and isinstance(groups[0], FullAttentionManager), "group 0 is full attention"
        assert all(isinstance(g, SlidingWindowManager) for g in groups[1:]), groups
        assert len({g.page_size for g in groups}) == 1, "every group has the same page size"
        self.groups = groups
        self.windows: list[SlidingWindowManager] = [g for g in groups if isinstance(g, SlidingWindowManager)]
        for w in self.windows:
            w.window_aware = window_aware
        self.page_size = groups[0].page_size
        self.window_aware = window_aware
        self.radix: RadixCache | None = None
        self.host_tier = host_tier if enable_prefix_cache and window_aware else None
        # Positions below the next query whose window is kept as well (speculative decoding: the
        # MTP heads' queries trail the target's by up to k + 1 positions).
        self.window_extra_tokens = 0
        # Speculative decoding: a prefix hit backs off to the previous hit point (see match_prefix).
        self.mtp_backoff = False
        # KV copied in (imports, host-tier restores) and store fetches, by request id.
        self.transfers = KVTransfers()
        # Prompts' KV that requests bring (P/D imports): the first connector asked at admission.
        self.imports = PromptImports()
        self.connectors: list[KVConnector] = []
        self.connect_tiers()
        self._budgets = self._budgets_of()
        # Each sequence's KV state (its pages, pins and prefix lock), by request id
        self._held: dict[RequestId, SeqKV] = {}
        self._peeks: weakref.WeakKeyDictionary[Sequence, tuple[tuple[int, int], int]] = (
            weakref.WeakKeyDictionary()
        )
        if enable_prefix_cache:
            self.radix = RadixCache(
                self.page_size,
                [g.window for g in groups],
                [g.pool.free for g in groups],
                window_aware=window_aware,
                record_events=record_events,
                on_delete=self._spill if self.host_tier is not None else None,
            )

    # ---- geometry ------------------------------------------------------------------------
    @property
    def full_pool(self) -> PageAllocator:
        return self.groups[0].pool

    def pages_needed(self, seq: Sequence, n: int) -> PageNeed:
        """New pages of each group that computing the next ``n`` tokens of ``seq`` takes.

        Every row always has one entry per logical page, and every window entry from the window
        start on is resident (``check_integrity`` verifies it), so every group needs one page per
        new logical page.
        """
        new = max(0, math.ceil((seq.num_computed_tokens + n) / self.page_size) - self.of(seq).num_pages)
        return PageNeed((new,) * len(self.groups))

    # ---- the sequences' KV state -----------------------------------------------------------
    def of(self, seq: Sequence) -> SeqKV:
        """``seq``'s KV state (read it, do not change it): empty while it holds nothing."""
        return self._held.get(seq.seq_id, _EMPTY)

    def rows(self, seq: Sequence) -> list[list[int]]:
        """``seq``'s page row per KV group ([] while it holds none): what its page tables map."""
        st = self._held.get(seq.seq_id)
        return [] if st is None else st.pages

    def _state(self, seq: Sequence) -> SeqKV:
        """``seq``'s KV state, made (one empty row per group) on first use."""
        st = self._held.get(seq.seq_id)
        if st is None:
            st = self._held[seq.seq_id] = SeqKV(
                [[] for _ in self.groups], num_released=[0] * len(self.groups)
            )
        return st

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
        st = self._state(seq)
        assert not st.num_pages and st.prefix_lock is None and seq.num_computed_tokens == 0
        if self.transfers.source(seq.seq_id) is None:
            bringer = next((c for c in self.connectors if c.covers_prompt(seq)), None)
            if bringer is not None:
                self.transfers.set_source(seq.seq_id, bringer.copy_in(seq, 0))
        if self.transfers.source(seq.seq_id) is not None:
            # The whole prompt's KV comes by copy (brought, or a copy a preemption cut short):
            # nothing to borrow; pin only a window the payload holds (``layer_plan.py``).
            self.pin_prompt_end(seq, seq.num_prompt_tokens // self.page_size * self.page_size)
            return 0
        if self.radix is None:
            return 0
        hit = self.radix.match_prefix(seq.cache_keys, seq.num_tokens - 1)
        if self.mtp_backoff and hit.length:
            # The MTP heads' KV at a cached prefix's last positions was computed from tokens past
            # it (layer j at i reads token i + j + 1): resume from the previous hit point instead,
            # so the target recomputes that part and the heads with it (``speculative.py``).
            hit = self.radix.match_prefix(seq.cache_keys, hit.length - 1)
        if any(c.must_wait(seq, hit.length) for c in self.connectors):
            return None  # its KV is on its way (a store fetch): admitted once it is here
        st.prefix_lock = self.radix.lock(hit.node)
        st.pages = [list(row) for row in hit.pages]
        st.num_borrowed_pages = len(hit.full_pages)
        st.num_released = [g.first_live_page(hit.length) for g in self.groups]
        seq.num_computed_tokens = hit.length
        seq.num_cached_tokens = hit.length
        if self.window_aware and hit.key_length > hit.length and self._can_pin():
            st.pin_end = hit.key_length
        for connector in self.connectors:  # the first that copies KV in from the hit on
            src = connector.copy_in(seq, hit.length)
            if src is not None:
                self.transfers.set_source(seq.seq_id, src)
                if st.pin_end and st.pin_end <= src.end:
                    # The branch point lies in the copied range, where window pages below the
                    # copy's own windows are never written: keeping them would cache unwritten KV
                    # as live.
                    st.pin_end = 0
                break
        self.pin_prompt_end(seq)
        return hit.length

    def _spill(self, node: RadixNode) -> None:
        assert self.host_tier is not None
        self.host_tier.spill(node.page_hashes, node.pages)

    def connect_tiers(self) -> None:
        """(Re)build the connectors consulted at admission from the host tier, in order: the
        store tier (when one is under the host tier), then the host tier. Called again when a
        store is attached to the host tier (``LLMEngine.attach_kv_store``). The prompts' imports
        come first, tiers or not."""
        self.connectors = [self.imports]
        if self.host_tier is None:
            return
        store = None
        if self.host_tier.store is not None:
            store = StoreTierConnector(self.host_tier, self.transfers, self.page_size)
            self.connectors.append(store)
        self.connectors.append(HostTierConnector(self.host_tier, self.page_size, store))

    def request_finished(self, request_id: int | str) -> None:
        """The request finished or was aborted: its transfers and connectors' state go, and its
        KV state once it holds nothing (``release`` gives its pages back)."""
        st = self._held.get(request_id)
        if st is not None and not st.num_pages and st.prefix_lock is None:
            del self._held[request_id]
        self.transfers.release(request_id)
        for connector in self.connectors:
            connector.request_finished(request_id)

    def pin_prompt_end(self, seq: Sequence, end: int | None = None) -> None:
        """Keep each window group's window of the prompt's last page boundary until release, so the tree
        learns a hit there: a repeat of the prompt, or the conversation's next turn (which re-sends
        this prompt, and a reply that rarely re-tokenizes to the ids generated), resumes at the
        prompt's end instead of where the decode's moving window left off. The boundary is the
        last one a repeat can use (a hit always leaves one token to compute). ``end``: another
        boundary (an imported prompt pins the one whose window its payload holds)."""
        if not self.window_aware or not self._can_pin():
            return
        if end is None:
            end = (seq.num_prompt_tokens - 1) // self.page_size * self.page_size
        st = self._state(seq)
        if end > max(seq.num_computed_tokens, st.pin_end):
            st.prompt_pin = end

    def _can_pin(self) -> bool:
        # Pinning holds up to one extra window per sequence; only where every window group's pool
        # has room to spare (allocate() drops a sequence's pin anyway when its own pages would not
        # fit). Nothing to pin without a window group.
        return bool(self.windows) and all(w.can_pin() for w in self.windows)

    # ---- allocation ----------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, n: int) -> bool:
        need = self.pages_needed(seq, n)
        return self._available(need)

    def _budgets_of(self) -> list[tuple[PagePool, list[int]]]:
        """The free lists the groups draw from, each with its groups' indices: one shared block
        pool for every group, or a pool per group."""
        out: dict[int, tuple[PagePool, list[int]]] = {}
        for g, group in enumerate(self.groups):
            blocks = group.pool.blocks
            out.setdefault(id(blocks), (blocks, []))[1].append(g)
        return list(out.values())

    def _cost(self, members: list[int], pages: tuple[int, ...] | list[int]) -> int:
        """Entries of one free list that ``pages[g]`` pages of each group ``g`` in ``members`` take."""
        return sum(self.groups[g].pool.cost(pages[g]) for g in members)

    def _evictable(self, g: int) -> int:
        """Pages of group ``g`` eviction can free: unlocked tree pages, and for a window group
        also the window pages of locked nodes that no lock needs."""
        radix = self.radix
        assert radix is not None
        return radix.evictable_full_pages() if g == 0 else radix.evictable_window_pages(g)

    def _available(self, need: PageNeed) -> bool:
        for blocks, members in self._budgets:
            want = self._cost(members, need.per_group)
            if want <= blocks.num_free:
                continue
            if self.radix is None:
                return False
            # Evicting full KV from the tree also frees the window KV of those nodes, but not the
            # other way round; the bound counts each group's evictable pages once.
            evictable = sum(self.groups[g].pool.cost(self._evictable(g)) for g in members)
            if want > blocks.num_free + evictable:
                return False
        return True

    def allocate(self, seq: Sequence, n: int) -> bool:
        """Give ``seq`` pages for positions [c, c+n); evicts cached KV when a pool is short.

        Returns False, taking nothing, when the pools cannot hold it even after eviction.
        """
        if seq.num_computed_tokens + n <= self.of(seq).num_pages * self.page_size:
            return True  # the pages held already cover them (most decode steps): nothing to take
        need = self.pages_needed(seq, n)
        if not self._available(need) and not (self.unpin(seq) and self._available(need)):
            return False
        if self.radix is not None:
            for blocks, members in self._budgets:
                want = self._cost(members, need.per_group)
                # Windows first: trimming and tombstoning window KV keeps the tree's full KV (and
                # an unlocked leaf goes whole); then whole least recently used leaves.
                for g in sorted(members, key=lambda g: g == 0):
                    short = want - blocks.num_free
                    if short <= 0:
                        break
                    count = -(-short // self.groups[g].pool.blocks_per_page)  # its pages that free as much
                    if g == 0:
                        self.radix.evict_full(count)
                    else:
                        self.radix.evict_window(count, g)
        got = [group.pool.alloc(n) for n, group in zip(need.per_group, self.groups, strict=True)]
        if any(pages is None for pages in got):  # pragma: no cover - _available() guarantees room
            for pages, group in zip(got, self.groups, strict=True):
                group.pool.free(pages or [])
            return False
        for row, pages in zip(self._state(seq).pages, got, strict=True):
            assert pages is not None
            row.extend(pages)
        return True

    def commit(self, seq: Sequence, n: int) -> None:
        """Record that ``n`` more tokens of ``seq`` have KV; drop window pages that left their window."""
        seq.num_computed_tokens += n
        assert seq.num_computed_tokens <= self.of(seq).num_pages * self.page_size
        self.free_out_of_window(seq)

    def free_out_of_window(self, seq: Sequence) -> int:
        """Drop window pages below the window of the last page boundary, in every window group;
        returns how many were freed.

        The window kept is that of ``b = c // page * page`` rather than of ``c`` itself: ``b`` is
        where a later request can resume from this sequence's cached pages, and its window
        [b-W+1, b) reaches at most one page below c's. It costs nothing at the peak: a decode step
        still holds at most ``window_pages`` pages (the next page is not needed until
        c reaches it, and then b moves with it).
        """
        st = self._held.get(seq.seq_id)
        if not self.windows or st is None:
            return 0
        b = seq.num_computed_tokens // self.page_size * self.page_size
        upto = min(b, max(0, seq.num_computed_tokens - self.window_extra_tokens))
        ends = st.pin_ends
        freed = 0
        for g, group in enumerate(self.groups):
            if isinstance(group, SlidingWindowManager):
                lo = group.first_live_page(upto)
                if lo > st.num_released[g]:
                    freed += group.free_below(st, g, lo, group.pinned_pages(ends))
        return freed

    def unpin(self, seq: Sequence) -> bool:
        """Drop ``seq``'s pinned windows (the pages it already moved past); True if any."""
        st = self._held.get(seq.seq_id)
        if st is None or not self.windows:
            return False
        ends = st.pin_ends
        if not any(ends):
            return False
        st.pin_end = st.prompt_pin = 0
        dropped = False
        for g, group in enumerate(self.groups):
            if isinstance(group, SlidingWindowManager):
                dropped = group.drop_pins(st, g, group.pinned_pages(ends)) or dropped
        return dropped

    # ---- release -------------------------------------------------------------------------
    def release(self, seq: Sequence, cache: bool = True) -> None:
        """Give back all of ``seq``'s KV: computed whole pages into the prefix cache, the rest freed.

        Used at finish, abort and preemption; afterwards ``seq`` holds no pages and no lock.
        """
        st = self._held.pop(seq.seq_id, _EMPTY)
        nb = st.num_borrowed_pages
        # A half-copied import holds window pages whose positions were never written: never cached.
        cache = cache and not self.transfers.copying(seq)
        if self.radix is not None and cache:
            computed = seq.num_computed_tokens
            if seq.cacheable_tokens is not None:
                computed = min(computed, seq.cacheable_tokens)
            n = computed // self.page_size
            key = seq.cache_keys[: n * self.page_size]
            tokens = seq.token_slice(0, n * self.page_size) if self.radix.record_events else None
            if st.pages:
                res: InsertResult = self.radix.insert(key, *(row[:n] for row in st.pages), tokens=tokens)
                for group, row, spare in zip(self.groups, st.pages, res.to_free, strict=True):
                    group.pool.free(spare)
                    group.pool.free(row[n:])
        else:
            for group, row in zip(self.groups, st.pages, strict=False):  # no rows: nothing held
                group.pool.free(row[nb:])
        if st.prefix_lock is not None:
            assert self.radix is not None
            self.radix.unlock(st.prefix_lock)
        src = self.transfers.source(seq.seq_id)
        if src is not None and src.first_token is None:
            self.transfers.set_source(
                seq.seq_id, None
            )  # a restore (not an import): the next admission matches anew

    # ---- accounting ----------------------------------------------------------------------
    def capacity_error(self, num_pages: int) -> str | None:
        """Why a sequence of ``num_pages`` logical pages could never run, even alone with the tree
        empty; None when it could."""
        needs = [g.pages_per_sequence(num_pages) for g in self.groups]
        for blocks, members in self._budgets:
            want = self._cost(members, needs)
            if want > blocks.num_pages:
                kinds = " and ".join(
                    f"{needs[g]} {'full' if (w := self.groups[g].window) is None else f'window-{w}'}"
                    for g in members
                )
                unit = "pages" if blocks is self.groups[members[0]].pool else "blocks"
                return f"needs {kinds} KV pages ({want} {unit}), the pool {blocks.name!r} holds {blocks.num_pages}"
        return None

    def check_integrity(self, seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError unless every used page has exactly one owner and locks match holders.

        ``seqs`` must be every sequence that holds pages (running ones).
        """
        for group in self.groups:
            group.pool.check_integrity()
        for blocks, members in self._budgets:  # each block in use is one group's, once
            check_blocks(blocks, (self.groups[g].pool for g in members))
        seqs = list(seqs)
        owned: list[list[int]] = [[] for _ in self.groups]
        tree: list[set[int]] = [set() for _ in self.groups]
        if self.radix is not None:
            locks = [st.prefix_lock for s in seqs if (st := self.of(s)).prefix_lock is not None]
            self.radix.check_integrity(locks)
            for g in range(len(self.groups)):
                owned[g].extend(self.radix.pages_held(g))
                tree[g] = set(owned[g])
        holders = {sid for sid, st in self._held.items() if st.num_pages or st.prefix_lock is not None}
        unknown = holders - {s.seq_id for s in seqs}
        if unknown:
            raise AssertionError(f"KV held for sequences not given: {sorted(map(str, unknown))}")
        for s in seqs:
            st = self.of(s)
            nb = st.num_borrowed_pages
            if st.num_pages < math.ceil(s.num_computed_tokens / self.page_size):
                raise AssertionError(f"seq {s.seq_id}: computed tokens without full pages")
            if st.pages and len(st.pages) != len(self.groups):
                raise AssertionError(
                    f"seq {s.seq_id}: {len(st.pages)} page rows for {len(self.groups)} groups"
                )
            for g, row in enumerate(st.pages):
                if not tree[g].issuperset(p for p in row[:nb] if p != NOT_RESIDENT):
                    raise AssertionError(f"seq {s.seq_id}: borrowed pages are not in the prefix cache")
                owned[g].extend(p for p in row[nb:] if p != NOT_RESIDENT)
                if len(row) != st.num_pages:
                    raise AssertionError(f"seq {s.seq_id}: page rows of different lengths")
                group = self.groups[g]
                if isinstance(group, SlidingWindowManager):
                    group.check_window(st, g, s.num_computed_tokens, s.seq_id)
        for g, group in enumerate(self.groups):
            mine, pool = owned[g], group.pool
            if len(mine) != len(set(mine)):
                raise AssertionError(f"{pool.name}: a page has two owners")
            if set(mine) != pool.used_pages():
                raise AssertionError(
                    f"{pool.name}: owned pages ({len(mine)}) differ from used pages ({pool.num_used}): leak or stray"
                )


def group_managers(kv: PagedKVCache) -> list[GroupManager]:
    """One manager per KV group of ``kv``, over that group's pool (``kv_groups`` order)."""
    return [
        SlidingWindowManager(kv.group_pool(g), g.spec.sliding_window)
        if g.spec.sliding_window is not None
        else FullAttentionManager(kv.group_pool(g))
        for g in kv.groups
    ]
