"""A free-list page allocator, and what the KV manager needs of any group's page allocator.

A KV group's pages come either from a ``PagePool`` of its own or, through ``kv_blocks.GroupBlocks``,
from one block pool every group shares. The KV manager checks a step's pages per *budget*: the
groups whose pages come from one free list (``PageAllocator.blocks``), each page costing
``blocks_per_page`` of its entries.

Imports: nothing of the project.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class PageAllocator(Protocol):
    """A KV group's pages: a ``PagePool``, or a group's share of a shared block pool."""

    name: str
    page_size: int
    num_pages: int  # the most pages this group can hold (alone, where the free list is shared)
    blocks_per_page: int

    @property
    def blocks(self) -> PagePool: ...
    @property
    def num_free(self) -> int: ...
    @property
    def num_used(self) -> int: ...
    def cost(self, n: int) -> int: ...
    def can_alloc(self, n: int) -> bool: ...
    def alloc(self, n: int) -> list[int] | None: ...
    def free(self, pages: Iterable[int]) -> None: ...
    def is_used(self, page: int) -> bool: ...
    def used_pages(self) -> set[int]: ...
    def held_blocks(self) -> list[int]: ...
    def check_integrity(self) -> None: ...


def check_blocks(blocks: PagePool, pools: Iterable[PageAllocator]) -> None:
    """``blocks``' free list is sound, and every entry in use is one page's of exactly one of
    ``pools`` (the allocators drawing from it), once."""
    blocks.check_integrity()
    taken = [b for pool in pools for b in pool.held_blocks()]
    if len(taken) != len(set(taken)) or set(taken) != blocks.used_pages():
        raise AssertionError(
            f"{blocks.name}: the pages take {len(taken)} blocks ({len(set(taken))} distinct),"
            f" {blocks.num_used} are in use"
        )


class PagePool:
    """A free-list allocator of ``num_pages`` pages of ``page_size`` tokens.

    Invariants (checked by ``check_integrity``): every page id is either free or used, never both;
    ``num_free + num_used == num_pages``; the free list has no duplicates. Freeing a page that is
    not in use is a bug in the caller and fails loudly instead of corrupting the free list.
    """

    def __init__(self, num_pages: int, page_size: int, name: str = "pool") -> None:
        if num_pages < 0 or page_size <= 0:
            raise ValueError(f"{name}: need num_pages >= 0 and page_size > 0, got {num_pages}, {page_size}")
        self.name = name
        self.num_pages = num_pages
        self.page_size = page_size
        # Pop from the end: low page ids are handed out first, which keeps small tests readable.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._in_use = bytearray(num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` distinct free pages, or None (and nothing taken) when fewer than ``n`` are free."""
        assert n >= 0, n
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        for p in pages:
            self._in_use[p] = 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool. Each must be in use; ``-1`` entries are not pages and are skipped."""
        for p in pages:
            if p < 0:
                continue
            if not self._in_use[p]:
                raise AssertionError(f"{self.name}: double free of page {p}")
            self._in_use[p] = 0
            self._free.append(p)

    # A pool of its own is its own budget: one page costs one of its pages (``GroupBlocks`` is
    # the other kind, a group's pages drawn from a shared block pool).
    blocks_per_page = 1

    @property
    def blocks(self) -> PagePool:
        """The free list this pool's pages come from: itself."""
        return self

    def cost(self, n: int) -> int:
        """Entries of ``blocks`` that ``n`` pages take."""
        return n

    def is_used(self, page: int) -> bool:
        return bool(self._in_use[page])

    def used_pages(self) -> set[int]:
        return {p for p in range(self.num_pages) if self._in_use[p]}

    def held_blocks(self) -> list[int]:
        """Entries of ``blocks`` its pages take: the pages themselves."""
        return sorted(self.used_pages())

    def check_integrity(self) -> None:
        """Raise AssertionError when the free list and the in-use map disagree."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"{self.name}: duplicate pages in the free list")
        if any(self._in_use[p] for p in free):
            raise AssertionError(f"{self.name}: a page is both free and in use")
        if len(free) + sum(self._in_use) != self.num_pages:
            raise AssertionError(
                f"{self.name}: free {len(free)} + used {sum(self._in_use)} != total {self.num_pages}"
            )
