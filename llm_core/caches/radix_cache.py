"""Group-aware radix prefix cache over cache keys, holding one row of pages per KV group.

A node owns a run of whole pages of the key, one row per KV group (``kv_groups``): group 0 is
full attention and always present; each sliding-window group's row is None once the node is a
*tombstone* in that group (its window KV was evicted, its full KV kept). Groups are independent:
a model with two window sizes tombstones and heals each on its own. The tree knows nothing of
sequences: the KV manager matches, locks, inserts and unlocks.

Why page granularity: a page is the unit of allocation and of sharing. A partly filled page
cannot be shared, because the owner would keep writing new tokens into the same physical page
that another sequence reads. So keys are cut into pages, edges hold whole pages, children are
keyed by their first page, and every match length is a multiple of ``page_size``.

When is a prefix a hit? Resuming at position ``b`` means the query at ``b`` attends keys
[b-W+1, b]: full layers need full KV of [0, b), window-W layers need their KV of [b-W+1, b). Each group
has its rule (full attention: the path is present; window W: the trailing ``W-1`` tokens, or all
of [0, b) when shorter, are live in that group) and the hit is the longest node boundary ``b`` on
the matched path that every group's rule accepts. With one window (MiMo)::

    page:   [  0   |  1   |  2   |  3   ]        W-1 = 2 pages of the window needed before b
    window: [ live | TOMB | live | live ]
    b = 1 page:   window [0, 1) live          valid
    b = 2 pages:  window [0, 2) has TOMB      not valid
    b = 3 pages:  window [1, 3) has TOMB      not valid
    b = 4 pages:  window [2, 4) live          valid: the hit is 4 pages

Eviction, by ``last_access`` (a counter; a match touches root-to-leaf so parents are older):
full eviction removes unlocked leaves (every group's pages); a window group's eviction first trims
nodes to the window their own end needs, then tombstones live nodes whose window is not locked (a
leaf with no lock at all is removed instead: a tombstone leaf can never end a hit). Locks:
``lock_ref`` on every node of a locked path (full KV in use); ``window_lock_ref[g]`` only on the
trailing nodes that cover group g's window (its KV in use), so the window KV of a running
sequence's older prefix can still be reclaimed. A later insert of the same tokens with live
window pages heals a tombstone.

``window_aware=False`` is the baseline a cache unaware of windows would be: a window group's
whole prefix must stay live for a hit, its eviction removes whole leaves, and no tombstone is ever
made.

Events (``record_events=True``): every change of what the tree holds is recorded, in order, as a
KV event a router can replay to know exactly what this tree would hit (``epd_common.messages.kv_events``; pages are
named by their chained content hash, ``epd_common.messages.page_hash``)::

    new pages                       BlockStored group 0 (full KV), + group g for each live window run
    tombstone healed                BlockStored group g
    window trimmed / tombstoned     BlockRemoved group g (its full KV stays: no group-0 event)
    node deleted                    BlockRemoved group 0 (+ group g where its window KV was live)

A split changes no page, so it emits nothing. ``drain_events`` hands them to the publisher.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence

from epd_common.messages.hit_rule import groups_accept
from epd_common.messages.kv_events import (
    FULL_GROUP,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from epd_common.messages.page_hash import page_hashes
from llm_core.caches.radix_node import InsertResult, MatchResult, PrefixLock, RadixNode

__all__ = ["NOT_RESIDENT", "InsertResult", "MatchResult", "PrefixLock", "RadixCache", "RadixNode"]

NOT_RESIDENT = -1


class RadixCache:
    """The tree, its eviction orders and its locks; pages are freed through the given callbacks.

    ``windows[g]``: group g's sliding window (keys per query, the query included), None for full
    attention; group 0 must be full attention (every node keeps it: it is what makes a path).
    ``frees[g]`` gives group g's pages back to its pool.

    Invariants (``check_integrity``): every node holds whole pages; a node's lock count is the
    number of held ``PrefixLock``s whose path passes through it, its window lock count in group g
    the number whose window in g covers it; a locked node is never evicted and a window-locked one
    never tombstoned in that group.
    """

    def __init__(
        self,
        page_size: int,
        windows: Sequence[int | None],
        frees: Sequence[Callable[[list[int]], None]],
        window_aware: bool = True,
        record_events: bool = False,
        on_delete: Callable[[RadixNode], None] | None = None,
    ) -> None:
        """``on_delete``: called with a node about to be removed, before its pages are freed (the
        host tier keeps them); pages are then named by their hashes, as with ``record_events``."""
        assert page_size > 0 and windows and windows[0] is None, windows
        assert all(w is not None and w >= 1 for w in windows[1:]), windows
        assert len(frees) == len(windows)
        self.page_size = page_size
        self.windows = tuple(windows)
        self.num_groups = len(windows)
        self.window_groups = tuple(range(1, self.num_groups))
        self.window_aware = window_aware
        self._frees = tuple(frees)
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self.root = RadixNode((), [[] for _ in windows], None, next(self._ids))
        self.root.lock_ref = 1  # never evicted
        self._nodes: dict[int, RadixNode] = {}
        # Bumped whenever a match result could change (insert, heal, eviction); callers cache on it.
        self.version = 0
        self.record_events = record_events
        self.on_delete = on_delete
        self._name_pages = record_events or on_delete is not None
        self._events: list[KVEvent] = []

    # ---- queries -------------------------------------------------------------------------
    def window_tokens(self, group: int) -> int:
        """Tokens of window group ``group`` that must be live right before a hit boundary (all of
        them when unaware of windows)."""
        w = self.windows[group]
        assert w is not None, f"group {group} is full attention"
        return w - 1 if self.window_aware else 1 << 62

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
            if m < len(child.key) // p:
                child = self._split(child, m)
            path.append(child)
            node = child
            i += m
        groups = self.window_groups
        need = [self.window_tokens(g) for g in groups]
        best = -1
        runs = [0] * len(groups)  # per window group: live tokens ending at the node's end
        for j, nd in enumerate(path):
            runs = [0 if nd.pages[g] is None else r + len(nd.key) for g, r in zip(groups, runs, strict=True)]
            if groups_accept(runs, nd.end_depth, need):
                best = j
        hit = path[: best + 1]
        if touch:
            for nd in hit:
                nd.last_access = next(self._clock)
        end = hit[-1] if hit else self.root
        length = end.end_depth
        rows: list[list[int]] = []
        for g in range(self.num_groups):
            row: list[int] = []
            for nd in hit:
                pages = nd.pages[g]
                row.extend(pages if pages is not None else [NOT_RESIDENT] * (len(nd.key) // p))
            if g:
                first_window_page = max(0, length - need[g - 1]) // p if length else 0
                row[:first_window_page] = [NOT_RESIDENT] * first_window_page
            rows.append(row)
        return MatchResult(length, rows, end, path[-1].end_depth if path else 0)

    def _common_pages(self, child: RadixNode, key: list[int], i: int, n_pages: int) -> int:
        p = self.page_size
        whole = min(len(child.key) // p, n_pages - i)
        if child.key[: whole * p] == tuple(key[i * p : (i + whole) * p]):
            return whole  # the common case: one slice comparison
        m = 1  # the first page matched through the children dict
        while m < len(child.key) // p and i + m < n_pages:
            if child.key[m * p : (m + 1) * p] != tuple(key[(i + m) * p : (i + m + 1) * p]):
                break
            m += 1
        return m

    # ---- locks ---------------------------------------------------------------------------
    def lock(self, node: RadixNode) -> PrefixLock:
        """Protect a hit: full KV of the whole path, each window group's KV of its trailing window."""
        need = [0] + [self.window_tokens(g) for g in self.window_groups]
        covered = [0] * self.num_groups
        window_from = [node.end_depth] * self.num_groups
        nd: RadixNode | None = node
        while nd is not None and nd is not self.root:
            nd.lock_ref += 1
            for g in self.window_groups:
                if covered[g] < need[g]:
                    assert nd.pages[g] is not None, f"locking a window that is not live: {nd} group {g}"
                    nd.window_lock_ref[g] += 1
                    covered[g] += len(nd.key)
                    window_from[g] = nd.start_depth
            nd = nd.parent
        return PrefixLock(node, tuple(window_from))

    def unlock(self, handle: PrefixLock) -> None:
        nd: RadixNode | None = handle.node
        while nd is not None and nd is not self.root:
            assert nd.lock_ref > 0, nd
            nd.lock_ref -= 1
            for g in self.window_groups:
                if nd.start_depth >= handle.window_from_depth[g]:
                    assert nd.window_lock_ref[g] > 0, nd
                    nd.window_lock_ref[g] -= 1
            nd = nd.parent

    # ---- insert --------------------------------------------------------------------------
    def insert(self, key: list[int], *rows: list[int], tokens: list[int] | None = None) -> InsertResult:
        """Cache ``key`` (a page multiple) with one row of pages per group (``rows[g]``: group g's
        page of each logical page, NOT_RESIDENT in a window group where its KV is not live).

        The tree keeps the pages it lacked (new nodes, healed tombstones) and returns the given
        pages it already had under other ids, for the caller to free. Given pages that are the
        tree's own (a locked hit the caller borrowed) are left alone. ``tokens``: the token ids
        behind ``key`` (media runs as their pad ids), for the events only (default: the key).
        """
        p = self.page_size
        n_pages = len(key) // p
        assert len(key) == n_pages * p and len(rows) == self.num_groups
        assert all(len(r) == n_pages for r in rows)
        hashes = page_hashes(key, p) if self._name_pages else []
        tokens = key if tokens is None else tokens
        to_free: list[list[int]] = [[] for _ in rows]
        node = self.root
        i = 0
        num_new = 0
        self.version += 1
        while i < n_pages:
            child = node.children.get(tuple(key[i * p : (i + 1) * p]))
            if child is None:
                self._add_new(node, key, rows, i, hashes, tokens)
                num_new = n_pages - i
                break
            m = self._common_pages(child, key, i, n_pages)
            if m < len(child.key) // p:
                child = self._split(child, m)
            split = self._split_for_heal(child, rows, i, m)
            if split:
                continue  # re-enter at the same i: the next pass matches the part that stays dead
            for g in self.window_groups:
                given = rows[g][i : i + m]
                have = child.pages[g]
                if have is None:
                    if NOT_RESIDENT not in given:  # all live (a live tail was split off above)
                        child.pages[g] = list(given)  # heal: the tree now owns these pages
                        self._stored(child, g, tokens)
                    else:
                        to_free[g].extend(x for x in given if x != NOT_RESIDENT)
                else:
                    to_free[g].extend(
                        x for x, t in zip(given, have, strict=True) if x != NOT_RESIDENT and x != t
                    )
            to_free[0].extend(x for x, t in zip(rows[0][i : i + m], child.full_pages, strict=True) if x != t)
            child.last_access = next(self._clock)
            node = child
            i += m
        return InsertResult(to_free, num_new)

    def _split_for_heal(self, child: RadixNode, rows: tuple[list[int], ...], i: int, m: int) -> bool:
        """Where ``child`` is a tombstone in a group and the given pages are live only in a tail of
        it, split the dead part off (only a live tail can heal); True when it split."""
        for g in self.window_groups:
            if child.pages[g] is not None:
                continue
            given = rows[g][i : i + m]
            live_from = m
            while live_from > 0 and given[live_from - 1] != NOT_RESIDENT:
                live_from -= 1
            if 0 < live_from < m:
                self._split(child, live_from)
                return True
        return False

    def _add_new(
        self,
        parent: RadixNode,
        key: list[int],
        rows: tuple[list[int], ...],
        i: int,
        hashes: list[int],
        tokens: list[int],
    ) -> None:
        """New nodes for pages [i, n): one per run of uniform liveness in every window group (a
        group dead in a run is a tombstone there)."""
        p = self.page_size
        n = len(rows[0])
        if self.record_events:
            self._events.append(
                self._stored_event(hashes[i:], _last_hash(parent), tokens[i * p :], FULL_GROUP)
            )

        def liveness(j: int) -> tuple[bool, ...]:
            return tuple(rows[g][j] != NOT_RESIDENT for g in self.window_groups)

        while i < n:
            live = liveness(i)
            j = i + 1
            while j < n and liveness(j) == live:
                j += 1
            pages: list[list[int] | None] = [list(rows[0][i:j])]
            pages += [
                list(rows[g][i:j]) if ok else None for g, ok in zip(self.window_groups, live, strict=True)
            ]
            nd = RadixNode(tuple(key[i * p : j * p]), pages, parent, next(self._ids), hashes[i:j])
            nd.last_access = next(self._clock)
            parent.children[nd.key[:p]] = nd
            self._nodes[nd.node_id] = nd
            for g, ok in zip(self.window_groups, live, strict=True):
                if ok:
                    self._stored(nd, g, tokens)
            parent = nd
            i = j

    def _split(self, child: RadixNode, m: int) -> RadixNode:
        """Cut ``child`` after ``m`` pages; returns the new node holding the first ``m`` pages.

        ``child`` keeps its identity (and its end depth) as the lower half, so lock handles that
        end at it stay valid. Lock counts are copied: every lock through ``child`` also covers the
        upper half, and window lock boundaries sit on node boundaries, so the copy is exact.
        """
        p = self.page_size
        assert 0 < m < len(child.key) // p
        parent = child.parent
        assert parent is not None
        top = RadixNode(
            child.key[: m * p],
            [row[:m] if row is not None else None for row in child.pages],
            parent,
            next(self._ids),
            child.page_hashes[:m],
        )
        top.lock_ref = child.lock_ref
        top.window_lock_ref = list(child.window_lock_ref)
        top.last_access = child.last_access
        parent.children[top.key[:p]] = top
        child.key = child.key[m * p :]
        child.pages = [row[m:] if row is not None else None for row in child.pages]
        child.page_hashes = child.page_hashes[m:]
        child.parent = top
        top.children[child.key[:p]] = child
        self._nodes[top.node_id] = top
        return top

    # ---- eviction ------------------------------------------------------------------------
    def evictable_full_pages(self) -> int:
        return sum(len(n.key) // self.page_size for n in self._nodes.values() if n.lock_ref == 0)

    def evictable_window_pages(self, group: int) -> int:
        """Pages of window group ``group`` that eviction in that group alone can free."""
        return sum(
            len(row)
            for n in self._nodes.values()
            if (row := n.pages[group]) is not None and n.window_lock_ref[group] == 0
        )

    def evict_full(self, num_pages: int) -> int:
        """Remove least recently used unlocked leaves until ``num_pages`` full pages are freed."""
        return self._evict_leaves(num_pages, lambda n: len(n.key) // self.page_size)

    def evict_window(self, num_pages: int, group: int) -> int:
        """Free at least ``num_pages`` pages of window group ``group``, least recently used first,
        cheapest loss first.

        1. Trim: a node's window pages more than W-1 tokens before its end serve no hit at a node
           boundary (only a future branch inside the node), so the node is split and its upper
           part tombstoned in the group; its own boundary stays a hit.
        2. Tombstone: a live node whose window KV is unlocked loses it (its full KV stays
           cached); an unlocked leaf goes entirely instead (a tombstone leaf can never end a hit).
        Window-unaware mode only removes whole leaves.
        """
        self.version += 1
        if not self.window_aware:
            return self._evict_leaves(num_pages, lambda n: len(n.pages[group] or ()))
        live = sorted(
            (n for n in self._nodes.values() if n.pages[group] is not None and n.window_lock_ref[group] == 0),
            key=lambda n: (n.last_access, n.node_id),
        )
        keep = math.ceil(self.window_tokens(group) / self.page_size)  # pages of one boundary's window
        freed = 0
        for nd in live:
            if freed >= num_pages:
                return freed
            row = nd.pages[group]
            if row is not None and len(row) > keep:
                top = self._split(nd, len(row) - keep) if keep else nd
                top_row = top.pages[group]
                assert top_row is not None and top.window_lock_ref[group] == 0
                freed += len(top_row)
                self._frees[group](top_row)
                top.pages[group] = None
                self._tombstoned(top, group)
        for nd in live:
            if freed >= num_pages:
                break
            row = nd.pages[group]
            if nd.node_id not in self._nodes or row is None or nd.window_lock_ref[group]:
                continue
            freed += len(row)
            if not nd.children and nd.lock_ref == 0:
                self._delete(nd)
                continue
            self._frees[group](row)
            nd.pages[group] = None
            self._tombstoned(nd, group)
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
            freed += gain(nd) if gain is not None else len(nd.key) // self.page_size
            for g, row in enumerate(nd.pages):
                if row is not None:
                    self._frees[g](row)
            if self.record_events:
                for g in self.window_groups:
                    if nd.pages[g] is not None:
                        self._events.append(BlockRemoved(tuple(nd.page_hashes), group_idx=g))
                self._events.append(BlockRemoved(tuple(nd.page_hashes), group_idx=FULL_GROUP))
            parent = nd.parent
            del parent.children[nd.key[: self.page_size]]
            del self._nodes[nd.node_id]
            if parent is self.root or parent.children or parent.lock_ref or not parent.is_tombstone:
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
        window = self.windows[group]
        return BlockStored(
            block_hashes=tuple(hashes),
            parent_block_hash=parent,
            token_ids=tuple(tokens[: len(hashes) * self.page_size]),
            block_size=self.page_size,
            group_idx=group,
            kv_cache_spec_kind="full_attention" if window is None else "sliding_window",
            kv_cache_spec_sliding_window=window,
        )

    def _stored(self, nd: RadixNode, group: int, tokens: list[int]) -> None:
        """``nd``'s pages were stored in ``group``; ``tokens`` is the inserted key's token row."""
        if self.record_events:
            parent = nd.parent
            assert parent is not None
            self._events.append(
                self._stored_event(nd.page_hashes, _last_hash(parent), tokens[nd.start_depth :], group)
            )

    def _tombstoned(self, nd: RadixNode, group: int) -> None:
        if self.record_events:
            self._events.append(BlockRemoved(tuple(nd.page_hashes), group_idx=group))

    # ---- introspection -------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    def pages_held(self, group: int) -> list[int]:
        return [p for n in self._nodes.values() if (row := n.pages[group]) is not None for p in row]

    def full_pages_held(self) -> list[int]:
        return self.pages_held(0)

    def num_tombstones(self) -> int:
        return sum(1 for n in self._nodes.values() if n.is_tombstone)

    def check_integrity(self, locks: list[PrefixLock] | None = None) -> None:
        """Raise AssertionError on a broken tree; with ``locks``, also check every lock count."""
        p = self.page_size
        seen = 0
        stack = [self.root]
        while stack:
            nd = stack.pop()
            for first, c in nd.children.items():
                seen += 1
                n_pages = len(c.key) // p
                if c.parent is not nd or c.key[:p] != first or len(c.key) != len(c.full_pages) * p:
                    raise AssertionError(f"bad edge {nd} -> {c}")
                if not c.full_pages or c.end_depth != nd.end_depth + len(c.key):
                    raise AssertionError(f"bad node {c}")
                if len(c.pages) != self.num_groups or len(c.window_lock_ref) != self.num_groups:
                    raise AssertionError(f"{c} has {len(c.pages)} page rows for {self.num_groups} groups")
                if any(row is not None and len(row) != n_pages for row in c.pages):
                    raise AssertionError(f"window pages of {c} do not match its full pages")
                if self._name_pages and len(c.page_hashes) != n_pages:
                    raise AssertionError(f"page hashes of {c} do not match its full pages")
                if c.lock_ref < max(c.window_lock_ref) or (c.lock_ref > nd.lock_ref and nd is not self.root):
                    raise AssertionError(f"lock counts out of order at {c}")
                if any(c.pages[g] is None and c.window_lock_ref[g] for g in self.window_groups):
                    raise AssertionError(f"tombstone {c} has a window lock")
                stack.append(c)
        if seen != len(self._nodes):
            raise AssertionError(f"{seen} reachable nodes, {len(self._nodes)} registered")
        if locks is None:
            return
        want: dict[int, list[int]] = {i: [0] * (1 + self.num_groups) for i in self._nodes}
        for h in locks:
            nd2: RadixNode | None = h.node
            while nd2 is not None and nd2 is not self.root:
                counts = want[nd2.node_id]
                counts[0] += 1
                for g in self.window_groups:
                    counts[1 + g] += nd2.start_depth >= h.window_from_depth[g]
                nd2 = nd2.parent
        for i, nd in self._nodes.items():
            have = [nd.lock_ref, 0, *nd.window_lock_ref[1:]]
            if have != want[i]:
                raise AssertionError(f"{nd}: lock counts {have}, holders say {want[i]}")


def _last_hash(node: RadixNode) -> int | None:
    """The hash of the page a child of ``node`` follows (None under the root)."""
    return node.page_hashes[-1] if node.page_hashes else None
