"""One manager per KV group: its page pool and the rules of its attention kind.

The KV manager (``kv_manager.py``) keeps a sequence's logical pages in step across groups (every
group's row has one entry per logical page) and asks each group's manager what is particular to
it: which of a sequence's pages the next queries can still read, which it may free, and what a
cached prefix must keep for a hit (``epd_common.messages.hit_rule``)::

    FullAttentionManager      every page of [0, c) is read by every later query: nothing is freed
                              before release; a hit needs the whole path (no window rule)
    SlidingWindowManager(W)   a query at p reads [p-W+1, p]: pages below the window of the last
                              page boundary are freed as the sequence moves on (except pinned
                              ones); a hit at b needs the W-1 tokens before b live

``window_aware=False`` makes a sliding-window group keep everything like full attention (the
baseline a cache unaware of windows would be); its hit rule then asks for the whole prefix.
Managers know nothing of the radix tree; they free through their pool.
"""

from __future__ import annotations

from llm_core.caches.kv_groups import window_pages
from llm_core.caches.page_pool import PageAllocator
from llm_core.caches.seq_kv import NOT_RESIDENT, SeqKV


class FullAttentionManager:
    """The full-attention group: group 0, the one every cached page belongs to."""

    window: int | None = None

    def __init__(self, pool: PageAllocator) -> None:
        self.pool = pool
        self.page_size = pool.page_size

    def first_live_page(self, num_computed: int) -> int:
        return 0

    def pages_per_sequence(self, num_pages: int) -> int:
        """Pages one sequence of ``num_pages`` logical pages holds at its peak."""
        return num_pages


class SlidingWindowManager:
    """A sliding-window group of window ``window`` (keys per query, the query included)."""

    def __init__(self, pool: PageAllocator, window: int, window_aware: bool = True) -> None:
        assert window >= 1, window
        self.pool = pool
        self.page_size = pool.page_size
        self.window: int | None = window
        self.window_aware = window_aware

    @property
    def sliding_window(self) -> int:
        assert self.window is not None
        return self.window

    def first_live_page(self, num_computed: int) -> int:
        """Lowest logical page any query at position >= ``num_computed`` can read."""
        if not self.window_aware:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.page_size

    def pages_per_sequence(self, num_pages: int) -> int:
        """Pages one decoding sequence of ``num_pages`` logical pages keeps resident at its peak."""
        if not self.window_aware:
            return num_pages
        return min(num_pages, window_pages(self.sliding_window, self.page_size))

    def can_pin(self) -> bool:
        """Pinning holds up to one extra window per sequence; only where the pool has room to
        spare (the KV manager drops a sequence's pin when its own pages would not fit)."""
        return self.pool.num_pages >= 4 * window_pages(self.sliding_window, self.page_size)

    def pinned_pages(self, pin_ends: tuple[int, ...]) -> list[tuple[int, int]]:
        """Logical pages [lo, hi) of the windows before each pinned position (0: no pin)."""
        return [(self.first_live_page(end), end // self.page_size) for end in pin_ends if end]

    def free_below(self, seq: SeqKV, row: int, lo: int, pins: list[tuple[int, int]]) -> int:
        """Drop a sequence's pages of this group (``seq.pages[row]``) below logical page ``lo``,
        but not the pinned ones; returns how many went back to the pool (borrowed pages belong to
        the tree: the sequence only stops referencing them)."""
        pages = seq.pages[row]
        done = seq.num_released[row]
        if lo <= done:
            return 0  # the window start did not pass a page since the last call (most steps)
        freed: list[int] = []
        for i in range(done, min(lo, len(pages))):
            if any(pin_lo <= i < pin_hi for pin_lo, pin_hi in pins):
                continue
            page = pages[i]
            if page != NOT_RESIDENT and i >= seq.num_borrowed_pages:
                freed.append(page)
            pages[i] = NOT_RESIDENT
        seq.num_released[row] = max(done, lo)
        self.pool.free(freed)
        return len(freed)

    def drop_pins(self, seq: SeqKV, row: int, pins: list[tuple[int, int]]) -> bool:
        """Free the pinned pages the sequence already moved past; True if any page or range went."""
        pages = seq.pages[row]
        freed: list[int] = []
        moved = False
        for pin_lo, pin_hi in pins:
            upto = min(pin_hi, seq.num_released[row])
            moved = moved or upto > pin_lo
            for i in range(pin_lo, upto):
                page = pages[i]
                if page != NOT_RESIDENT and i >= seq.num_borrowed_pages:
                    freed.append(page)
                pages[i] = NOT_RESIDENT
        self.pool.free(freed)
        return bool(freed) or moved

    def check_window(self, seq: SeqKV, row: int, num_computed: int, seq_id: object) -> None:
        lo = self.first_live_page(num_computed)
        if NOT_RESIDENT in seq.pages[row][lo:]:
            raise AssertionError(f"seq {seq_id}: a page of group {row}'s live window is missing")


GroupManager = FullAttentionManager | SlidingWindowManager
