"""Radix tree nodes and the named results the SWA-aware prefix cache hands out.

A node owns whole pages of its edge key: ``full_pages`` always, ``swa_pages`` unless it is a
tombstone (None). Depths are in tokens from the root; they never change for a node's end, even
when the node is split (the upper half becomes a new parent). See radix_cache.py for the tree.
"""

from __future__ import annotations

from typing import NamedTuple


class RadixNode:
    """One edge of the tree: a run of whole pages of the key, with its KV pages and lock counts."""

    __slots__ = (
        "children",
        "end_depth",
        "full_pages",
        "key",
        "last_access",
        "lock_ref",
        "node_id",
        "page_hashes",
        "parent",
        "swa_lock_ref",
        "swa_pages",
    )

    def __init__(
        self,
        key: tuple[int, ...],
        full_pages: list[int],
        swa_pages: list[int] | None,
        parent: RadixNode | None,
        node_id: int,
        page_hashes: list[int] | None = None,
    ) -> None:
        self.key = key
        # The chained content hash of each page (``page_hash.page_hashes``): the pages' names in
        # the KV events a router reads. Empty when the tree does not record events.
        self.page_hashes: list[int] = page_hashes if page_hashes is not None else []
        self.full_pages = full_pages
        self.swa_pages = swa_pages  # None: tombstone
        self.parent: RadixNode | None = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.end_depth: int = (parent.end_depth if parent is not None else 0) + len(key)
        self.lock_ref = 0
        self.swa_lock_ref = 0
        self.last_access = 0
        self.node_id = node_id

    @property
    def start_depth(self) -> int:
        return self.end_depth - len(self.key)

    @property
    def is_tombstone(self) -> bool:
        return self.swa_pages is None

    def __repr__(self) -> str:
        state = "tomb" if self.swa_pages is None else "live"
        return f"RadixNode(#{self.node_id} [{self.start_depth}, {self.end_depth}) {state} lock={self.lock_ref}/{self.swa_lock_ref})"


class MatchResult(NamedTuple):
    """A usable prefix: ``length`` tokens (a page multiple) of KV ready in both pools.

    ``full_pages[i]`` and ``swa_pages[i]`` are logical page ``i``; ``swa_pages`` holds only the
    window's pages (NOT_RESIDENT before it). ``node`` ends the hit (the root when there is none);
    pass it to ``lock`` before using the pages. ``key_length`` is how far the key matched the
    tree at all (full KV present); beyond ``length`` it is a branch point whose SWA window is gone.
    """

    length: int
    full_pages: list[int]
    swa_pages: list[int]
    node: RadixNode
    key_length: int


class PrefixLock(NamedTuple):
    """Handle of a lock: the hit's last node and where its SWA lock starts (a node boundary)."""

    node: RadixNode
    swa_from_depth: int


class InsertResult(NamedTuple):
    """Pages the caller gave but the tree did not keep (the same tokens were already cached)."""

    full_to_free: list[int]
    swa_to_free: list[int]
    num_new_pages: int  # pages of key that created new nodes
