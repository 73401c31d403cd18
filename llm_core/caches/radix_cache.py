"""SWA-aware radix prefix cache over cache keys, holding full-pool and SWA-pool pages.

A node owns a run of whole pages of the key: ``full_pages`` (always present) and ``swa_pages``
(None once the node is a *tombstone*: its SWA KV was evicted, its full KV kept). The tree knows
nothing of sequences: the KV manager matches, locks, inserts and unlocks.

Why page granularity: a page is the unit of allocation and of sharing. A partly filled page
cannot be shared, because the owner would keep writing new tokens into the same physical page
that another sequence reads. So keys are cut into pages, edges hold whole pages, children are
keyed by their first page, and every match length is a multiple of ``page_size``.

When is a prefix a hit? Resuming at position ``b`` means the query at ``b`` attends keys
[b-W+1, b]: full layers need full KV of [0, b), SWA layers need SWA KV of [b-W+1, b). So the hit
is the longest node boundary ``b`` on the matched path whose trailing ``W-1`` tokens (or all of
[0, b) when shorter) are live in the SWA pool, i.e. the min over both attention types::

    page:   [  0   |  1   |  2   |  3   ]        W-1 = 2 pages of SWA needed before b
    SWA:    [ live | TOMB | live | live ]
    b = 1 page:   window [0, 1) live          valid
    b = 2 pages:  window [0, 2) has TOMB      not valid
    b = 3 pages:  window [1, 3) has TOMB      not valid
    b = 4 pages:  window [2, 4) live          valid: the hit is 4 pages

Two LRU orders, by ``last_access`` (a counter; a match touches root-to-leaf so parents are older):
full eviction removes unlocked leaves (both pages); SWA eviction first trims nodes to the window
their own end needs, then tombstones live nodes whose window is not locked (a leaf with no lock
at all is removed instead: a tombstone leaf can never end a hit). Locks: ``lock_ref`` on every node of a locked path (full KV in use); ``swa_lock_ref``
only on the trailing nodes that cover the window (SWA KV in use), so the SWA of a running
sequence's older prefix can still be reclaimed. A later insert of the same tokens with live SWA
pages heals a tombstone.

``swa_aware=False`` is the baseline a SWA-unaware cache would be: the whole SWA prefix must stay
live for a hit, SWA eviction removes whole leaves, and no tombstone is ever made.

Events (``record_events=True``): every change of what the tree holds is recorded, in order, as a
KV event a router can replay to know exactly what this tree would hit (``kv_events.py``; pages are
named by their chained content hash, ``page_hash.py``)::

    new pages                       BlockStored group 0 (full KV), + group 1 for the live SWA runs
    tombstone healed                BlockStored group 1
    SWA trimmed / tombstoned        SwaTombstoned
    node deleted                    BlockRemoved group 0 (+ group 1 where its SWA was live)

A split changes no page, so it emits nothing. ``drain_events`` hands them to the publisher.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

from llm_core.caches.kv_events import (
    FULL_GROUP,
    SWA_GROUP,
    BlockRemoved,
    BlockStored,
    KVEvent,
    SwaTombstoned,
)
from llm_core.caches.page_hash import page_hashes
from llm_core.caches.radix_node import InsertResult, MatchResult, PrefixLock, RadixNode

__all__ = ["NOT_RESIDENT", "InsertResult", "MatchResult", "PrefixLock", "RadixCache", "RadixNode"]

NOT_RESIDENT = -1


class RadixCache:
    """The tree, its two eviction orders and its locks; pages are freed through the given callbacks.

    Invariants (``check_integrity``): every node holds whole pages; a node's lock count is the
    number of held ``PrefixLock``s whose path passes through it, its SWA lock count the number
    whose window covers it; a locked node is never evicted and a SWA-locked one never tombstoned.
    """

    def __init__(
        self,
        page_size: int,
        sliding_window: int,
        free_full: Callable[[list[int]], None],
        free_swa: Callable[[list[int]], None],
        swa_aware: bool = True,
        record_events: bool = False,
        on_delete: Callable[[RadixNode], None] | None = None,
    ) -> None:
        """``on_delete``: called with a node about to be removed, before its pages are freed (the
        host tier keeps them); pages are then named by their hashes, as with ``record_events``."""
        assert page_size > 0 and sliding_window >= 1
        self.page_size = page_size
        self.sliding_window = sliding_window
        self.swa_aware = swa_aware
        self._free_full = free_full
        self._free_swa = free_swa
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self.root = RadixNode((), [], [], None, next(self._ids))
        self.root.lock_ref = 1  # never evicted
        self._nodes: dict[int, RadixNode] = {}
        # Bumped whenever a match result could change (insert, heal, eviction); callers cache on it.
        self.version = 0
        self.record_events = record_events
        self.on_delete = on_delete
        self._name_pages = record_events or on_delete is not None
        self._events: list[KVEvent] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def window_tokens(self) -> int:
        """SWA tokens that must be live right before a hit boundary (all of them when SWA-unaware)."""
        return self.sliding_window - 1 if self.swa_aware else 1 << 62

    def match_prefix(self, key: list[int], max_len: int | None = None, touch: bool = True) -> MatchResult:
        """Longest usable prefix of ``key[:max_len]`` (page-aligned). Splits a node matched in part."""
        p = self.page_size
        limit = len(key) if max_len is None else min(len(key), max_len)
        n_pages = limit // p
        path: list[RadixNode] = []
        node = self.root
        i = 0
        while i < n_pages:
            child = node.children.get(tuple(key[i * p : (i + 1) * p]))
            if child is None:
                break
            m = self._common_pages(child, key, i, n_pages)
            if m < len(child.full_pages):
                child = self._split(child, m)
            path.append(child)
            node = child
            i += m
        need = self.window_tokens
        best = -1
        run = 0
        for j, nd in enumerate(path):
            run = 0 if nd.swa_pages is None else run + len(nd.key)
            if run >= min(need, nd.end_depth):
                best = j
        hit = path[: best + 1]
        if touch:
            for nd in hit:
                nd.last_access = next(self._clock)
        end = hit[-1] if hit else self.root
        full: list[int] = []
        swa: list[int] = []
        for nd in hit:
            full.extend(nd.full_pages)
            swa.extend(nd.swa_pages if nd.swa_pages is not None else [NOT_RESIDENT] * len(nd.full_pages))
        length = end.end_depth
        first_window_page = max(0, length - need) // p if length else 0
        swa[:first_window_page] = [NOT_RESIDENT] * first_window_page
        return MatchResult(length, full, swa, end, path[-1].end_depth if path else 0)

    def _common_pages(self, child: RadixNode, key: list[int], i: int, n_pages: int) -> int:
        p = self.page_size
        whole = min(len(child.full_pages), n_pages - i)
        if child.key[: whole * p] == tuple(key[i * p : (i + whole) * p]):
            return whole  # the common case: one slice comparison
        m = 1  # the first page matched through the children dict
        while m < len(child.full_pages) and i + m < n_pages:
            if child.key[m * p : (m + 1) * p] != tuple(key[(i + m) * p : (i + m + 1) * p]):
                break
            m += 1
        return m

    # ---- locks ---------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> PrefixLock:
        """Protect a hit: full KV of the whole path, SWA KV of the trailing window."""
        need = self.window_tokens
        covered = 0
        swa_from = node.end_depth
        nd: RadixNode | None = node
        while nd is not None and nd is not self.root:
            nd.lock_ref += 1
            if covered < need:
                assert nd.swa_pages is not None, f"locking a window that is not live: {nd}"
                nd.swa_lock_ref += 1
                covered += len(nd.key)
                swa_from = nd.start_depth
            nd = nd.parent
        return PrefixLock(node, swa_from)

    def unlock(self, handle: PrefixLock) -> None:
        nd: RadixNode | None = handle.node
        while nd is not None and nd is not self.root:
            assert nd.lock_ref > 0, nd
            nd.lock_ref -= 1
            if nd.start_depth >= handle.swa_from_depth:
                assert nd.swa_lock_ref > 0, nd
                nd.swa_lock_ref -= 1
            nd = nd.parent

    # ---- insert --------------------------------------------------------------------------
    def insert(
        self,
        key: list[int],
        full_pages: list[int],
        swa_pages: list[int],
        tokens: list[int] | None = None,
    ) -> InsertResult:
        """Cache ``key`` (a page multiple) with one full page and one SWA entry per page.

        The tree keeps the pages it lacked (new nodes, healed tombstones) and returns the given
        pages it already had under other ids, for the caller to free. Given pages that are the
        tree's own (a locked hit the caller borrowed) are left alone. ``tokens``: the token ids
        behind ``key`` (media runs as their pad ids), for the events only (default: the key).
        """
        p = self.page_size
        n_pages = len(key) // p
        assert len(key) == n_pages * p and len(full_pages) == n_pages == len(swa_pages)
        hashes = page_hashes(key, p) if self._name_pages else []
        tokens = key if tokens is None else tokens
        full_free: list[int] = []
        swa_free: list[int] = []
        node = self.root
        i = 0
        num_new = 0
        self.version += 1
        while i < n_pages:
            child = node.children.get(tuple(key[i * p : (i + 1) * p]))
            if child is None:
                self._add_new(node, key, full_pages, swa_pages, i, hashes, tokens)
                num_new = n_pages - i
                break
            m = self._common_pages(child, key, i, n_pages)
            if m < len(child.full_pages):
                child = self._split(child, m)
            given_swa = swa_pages[i : i + m]
            if child.swa_pages is None:
                live_from = m
                while live_from > 0 and given_swa[live_from - 1] != NOT_RESIDENT:
                    live_from -= 1
                if 0 < live_from < m:
                    # Only a live tail can heal: split off the part that stays a tombstone and
                    # re-enter at the same i (the next pass matches the dead part).
                    self._split(child, live_from)
                    continue
                if live_from == 0:
                    child.swa_pages = list(given_swa)  # heal: the tree now owns these SWA pages
                    self._stored(child, SWA_GROUP, tokens)
                else:
                    swa_free.extend(g for g in given_swa if g != NOT_RESIDENT)
            else:
                swa_free.extend(
                    g for g, t in zip(given_swa, child.swa_pages, strict=True) if g != NOT_RESIDENT and g != t
                )
            full_free.extend(
                g for g, t in zip(full_pages[i : i + m], child.full_pages, strict=True) if g != t
            )
            child.last_access = next(self._clock)
            node = child
            i += m
        return InsertResult(full_free, swa_free, num_new)

    def _add_new(
        self,
        parent: RadixNode,
        key: list[int],
        full_pages: list[int],
        swa_pages: list[int],
        i: int,
        hashes: list[int],
        tokens: list[int],
    ) -> None:
        """New nodes for pages [i, n): one per run of uniform SWA liveness (dead runs are tombstones)."""
        p = self.page_size
        n = len(full_pages)
        if self.record_events:
            self._events.append(
                self._stored_event(hashes[i:], _last_hash(parent), tokens[i * p :], FULL_GROUP)
            )
        while i < n:
            live = swa_pages[i] != NOT_RESIDENT
            j = i + 1
            while j < n and (swa_pages[j] != NOT_RESIDENT) == live:
                j += 1
            nd = RadixNode(
                tuple(key[i * p : j * p]),
                list(full_pages[i:j]),
                list(swa_pages[i:j]) if live else None,
                parent,
                next(self._ids),
                hashes[i:j],
            )
            nd.last_access = next(self._clock)
            parent.children[nd.key[:p]] = nd
            self._nodes[nd.node_id] = nd
            if live:
                self._stored(nd, SWA_GROUP, tokens)
            parent = nd
            i = j

    def _split(self, child: RadixNode, m: int) -> RadixNode:
        """Cut ``child`` after ``m`` pages; returns the new node holding the first ``m`` pages.

        ``child`` keeps its identity (and its end depth) as the lower half, so lock handles that
        end at it stay valid. Lock counts are copied: every lock through ``child`` also covers the
        upper half, and SWA lock boundaries sit on node boundaries, so the copy is exact.
        """
        p = self.page_size
        assert 0 < m < len(child.full_pages)
        parent = child.parent
        assert parent is not None
        top = RadixNode(
            child.key[: m * p],
            child.full_pages[:m],
            child.swa_pages[:m] if child.swa_pages is not None else None,
            parent,
            next(self._ids),
            child.page_hashes[:m],
        )
        top.lock_ref = child.lock_ref
        top.swa_lock_ref = child.swa_lock_ref
        top.last_access = child.last_access
        parent.children[top.key[:p]] = top
        child.key = child.key[m * p :]
        child.full_pages = child.full_pages[m:]
        child.page_hashes = child.page_hashes[m:]
        if child.swa_pages is not None:
            child.swa_pages = child.swa_pages[m:]
        child.parent = top
        top.children[child.key[:p]] = child
        self._nodes[top.node_id] = top
        return top

    # ---- eviction ------------------------------------------------------------------------
    def evictable_full_pages(self) -> int:
        return sum(len(n.full_pages) for n in self._nodes.values() if n.lock_ref == 0)

    def evictable_swa_pages(self) -> int:
        return sum(
            len(n.swa_pages) for n in self._nodes.values() if n.swa_pages is not None and n.swa_lock_ref == 0
        )

    def evict_full(self, num_pages: int) -> int:
        """Remove least recently used unlocked leaves until ``num_pages`` full pages are freed."""
        return self._evict_leaves(num_pages, lambda n: len(n.full_pages))

    def evict_swa(self, num_pages: int) -> int:
        """Free at least ``num_pages`` SWA pages, least recently used first, cheapest loss first.

        1. Trim: a node's SWA pages more than W-1 tokens before its end serve no hit at a node
           boundary (only a future branch inside the node), so the node is split and its upper
           part tombstoned; its own boundary stays a hit.
        2. Tombstone: a live node whose SWA is unlocked loses it (its full KV stays cached); an
           unlocked leaf goes entirely instead (a tombstone leaf can never end a hit).
        SWA-unaware mode only removes whole leaves.
        """
        self.version += 1
        if not self.swa_aware:
            return self._evict_leaves(num_pages, lambda n: len(n.swa_pages or ()))
        live = sorted(
            (n for n in self._nodes.values() if n.swa_pages is not None and n.swa_lock_ref == 0),
            key=lambda n: (n.last_access, n.node_id),
        )
        keep = math.ceil((self.sliding_window - 1) / self.page_size)  # pages of one boundary's window
        freed = 0
        for nd in live:
            if freed >= num_pages:
                return freed
            if nd.swa_pages is not None and len(nd.swa_pages) > keep:
                top = self._split(nd, len(nd.swa_pages) - keep) if keep else nd
                assert top.swa_pages is not None and top.swa_lock_ref == 0
                freed += len(top.swa_pages)
                self._free_swa(top.swa_pages)
                top.swa_pages = None
                self._tombstoned(top)
        for nd in live:
            if freed >= num_pages:
                break
            if nd.node_id not in self._nodes or nd.swa_pages is None or nd.swa_lock_ref:
                continue
            freed += len(nd.swa_pages)
            if not nd.children and nd.lock_ref == 0:
                self._delete(nd)
                continue
            self._free_swa(nd.swa_pages)
            nd.swa_pages = None
            self._tombstoned(nd)
        return freed

    def _evict_leaves(self, num_pages: int, gain: Callable[[RadixNode], int]) -> int:
        """Delete unlocked leaves in LRU order until ``gain`` summed over deleted nodes reaches ``num_pages``."""
        self.version += 1
        heap = [
            (n.last_access, n.node_id, n) for n in self._nodes.values() if not n.children and n.lock_ref == 0
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, nd = heapq.heappop(heap)
            if nd.node_id not in self._nodes or nd.children or nd.lock_ref:
                continue
            anc = nd.parent
            freed += self._delete(nd, gain)
            while anc is not None and anc is not self.root and anc.node_id not in self._nodes:
                anc = anc.parent  # climb past tombstones the delete cascaded into
            if anc is not None and anc is not self.root and not anc.children and anc.lock_ref == 0:
                heapq.heappush(heap, (anc.last_access, anc.node_id, anc))
        return freed

    def _delete(self, nd: RadixNode, gain: Callable[[RadixNode], int] | None = None) -> int:
        """Remove leaf ``nd``, then any unlocked tombstone leaves it exposes; returns ``gain`` summed."""
        freed = 0
        while True:
            assert not nd.children and nd.lock_ref == 0 and nd.parent is not None
            if self.on_delete is not None:
                self.on_delete(nd)
            freed += gain(nd) if gain is not None else len(nd.full_pages)
            self._free_full(nd.full_pages)
            if nd.swa_pages is not None:
                self._free_swa(nd.swa_pages)
            if self.record_events:
                if nd.swa_pages is not None:
                    self._events.append(BlockRemoved(tuple(nd.page_hashes), group_idx=SWA_GROUP))
                self._events.append(BlockRemoved(tuple(nd.page_hashes), group_idx=FULL_GROUP))
            parent = nd.parent
            del parent.children[nd.key[: self.page_size]]
            del self._nodes[nd.node_id]
            if parent is self.root or parent.children or parent.lock_ref or parent.swa_pages is not None:
                return freed
            nd = parent  # a tombstone leaf can never end a hit: drop it too

    # ---- events ----------------------------------------------------------------------------
    def drain_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first (empty unless ``record_events``)."""
        out, self._events = self._events, []
        return out

    def _stored_event(
        self, hashes: list[int], parent: int | None, tokens: list[int], group: int
    ) -> BlockStored:
        swa = group == SWA_GROUP
        return BlockStored(
            block_hashes=tuple(hashes),
            parent_block_hash=parent,
            token_ids=tuple(tokens[: len(hashes) * self.page_size]),
            block_size=self.page_size,
            group_idx=group,
            kv_cache_spec_kind="sliding_window" if swa else "full_attention",
            kv_cache_spec_sliding_window=self.sliding_window if swa else None,
        )

    def _stored(self, nd: RadixNode, group: int, tokens: list[int]) -> None:
        """``nd``'s pages were stored in ``group``; ``tokens`` is the inserted key's token row."""
        if self.record_events:
            parent = nd.parent
            assert parent is not None
            self._events.append(
                self._stored_event(nd.page_hashes, _last_hash(parent), tokens[nd.start_depth :], group)
            )

    def _tombstoned(self, nd: RadixNode) -> None:
        if self.record_events:
            self._events.append(SwaTombstoned(tuple(nd.page_hashes)))

    # ---- introspection -------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def full_pages_held(self) -> list[int]:
        return [p for n in self._nodes.values() for p in n.full_pages]

    def swa_pages_held(self) -> list[int]:
        return [p for n in self._nodes.values() if n.swa_pages is not None for p in n.swa_pages]

    def num_tombstones(self) -> int:
        return sum(1 for n in self._nodes.values() if n.swa_pages is None)

    def check_integrity(self, locks: list[PrefixLock] | None = None) -> None:
        """Raise AssertionError on a broken tree; with ``locks``, also check every lock count."""
        p = self.page_size
        seen = 0
        stack = [self.root]
        while stack:
            nd = stack.pop()
            for first, c in nd.children.items():
                seen += 1
                if c.parent is not nd or c.key[:p] != first or len(c.key) != len(c.full_pages) * p:
                    raise AssertionError(f"bad edge {nd} -> {c}")
                if not c.full_pages or c.end_depth != nd.end_depth + len(c.key):
                    raise AssertionError(f"bad node {c}")
                if c.swa_pages is not None and len(c.swa_pages) != len(c.full_pages):
                    raise AssertionError(f"SWA pages of {c} do not match its full pages")
                if self._name_pages and len(c.page_hashes) != len(c.full_pages):
                    raise AssertionError(f"page hashes of {c} do not match its full pages")
                if c.lock_ref < c.swa_lock_ref or (c.lock_ref > nd.lock_ref and nd is not self.root):
                    raise AssertionError(f"lock counts out of order at {c}")
                if c.swa_pages is None and c.swa_lock_ref:
                    raise AssertionError(f"tombstone {c} has a SWA lock")
                stack.append(c)
        if seen != len(self._nodes):
            raise AssertionError(f"{seen} reachable nodes, {len(self._nodes)} registered")
        if locks is None:
            return
        want: dict[int, list[int]] = {i: [0, 0] for i in self._nodes}
        for h in locks:
            nd2: RadixNode | None = h.node
            while nd2 is not None and nd2 is not self.root:
                want[nd2.node_id][0] += 1
                want[nd2.node_id][1] += nd2.start_depth >= h.swa_from_depth
                nd2 = nd2.parent
        for i, nd in self._nodes.items():
            if [nd.lock_ref, nd.swa_lock_ref] != want[i]:
                raise AssertionError(
                    f"{nd}: lock counts {nd.lock_ref}/{nd.swa_lock_ref}, holders say {want[i]}"
                )


def _last_hash(node: RadixNode) -> int | None:
    """The hash of the page a child of ``node`` follows (None under the root)."""
    return node.page_hashes[-1] if node.page_hashes else None
