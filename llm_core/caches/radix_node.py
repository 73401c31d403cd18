"""Radix tree nodes and the named results the group-aware prefix cache hands out.

A node owns whole pages of its edge key, one row of page ids per KV group (``kv_groups``):
``pages[0]`` is the full-attention group's and always present; a sliding-window group's row is
None once the node is a *tombstone* in that group (its window KV was evicted, the full KV kept).
Depths are in tokens from the root; they never change for a node's end, even when the node is
split (the upper half becomes a new parent). See radix_cache.py for the tree.

``full_pages`` names group 0's row (the key's pages: every cached page has them).
"""

from __future__ import annotations

from typing import NamedTuple


class RadixNode:
    """One edge of the tree: a run of whole pages of the key, with each group's pages and locks."""

    __slots__ = (
        "children",
        "end_depth",
        "key",
        "last_access",
        "lock_ref",
        "node_id",
        "page_hashes",
        "pages",
        "parent",
        "window_lock_ref",
    )

    def __init__(
        self,
        key: tuple[int, ...],
        pages: list[list[int] | None],
        parent: RadixNode | None,
        node_id: int,
        page_hashes: list[int] | None = None,
    ) -> None:
        self.key = key
        # The chained content hash of each page (``page_hash.page_hashes``): the pages' names in
        # the KV events a router reads. Empty when the tree does not record events.
        self.page_hashes: list[int] = page_hashes if page_hashes is not None else []
        self.pages = pages  # [group] -> physical page per logical page, None: tombstone in that group
        self.parent: RadixNode | None = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.end_depth: int = (parent.end_depth if parent is not None else 0) + len(key)
        self.lock_ref = 0  # held hits whose path passes here (the full-attention KV is in use)
        # [group] held hits whose window in that group covers this node (0 for group 0)
        self.window_lock_ref = [0] * len(pages)
        self.last_access = 0
        self.node_id = node_id

    @property
    def full_pages(self) -> list[int]:
        pages = self.pages[0]
        assert pages is not None
        return pages

    @property
    def start_depth(self) -> int:
        return self.end_depth - len(self.key)

    @property
    def is_tombstone(self) -> bool:
        """A sliding-window group lost this node's KV."""
        return any(row is None for row in self.pages)

    def __repr__(self) -> str:
        state = "tomb" if self.is_tombstone else "live"
        locks = "/".join(str(n) for n in (self.lock_ref, *self.window_lock_ref[1:]))
        return f"RadixNode(#{self.node_id} [{self.start_depth}, {self.end_depth}) {state} lock={locks})"


class MatchResult(NamedTuple):
    """A usable prefix: ``length`` tokens (a page multiple) of KV ready in every group.

    ``pages[g][i]`` is group ``g``'s page of logical page ``i``; a sliding-window group's row
    holds only its window's pages (NOT_RESIDENT before it). ``node`` ends the hit (the root when
    there is none); pass it to ``lock`` before using the pages. ``key_length`` is how far the key
    matched the tree at all (full KV present); beyond ``length`` it is a branch point whose
    window KV is gone in some group.
    """

    length: int
    pages: list[list[int]]
    node: RadixNode
    key_length: int

    @property
    def full_pages(self) -> list[int]:
        return self.pages[0]


class PrefixLock(NamedTuple):
    """Handle of a lock: the hit's last node and, per group, where its window lock starts (a node
    boundary; the node's end when the group's window needs nothing)."""

    node: RadixNode
    window_from_depth: tuple[int, ...]


class InsertResult(NamedTuple):
    """Pages the caller gave but the tree did not keep (the same tokens were already cached), per
    group."""

    to_free: list[list[int]]
    num_new_pages: int  # pages of key that created new nodes

    @property
    def full_to_free(self) -> list[int]:
        return self.to_free[0]
