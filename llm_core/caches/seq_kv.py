"""One sequence's KV state, owned by the KV manager and kept there by request id.

The request record (``llm_core.request.Sequence``) carries tokens and progress; which pages hold
its KV, which of them the prefix cache lent it, which window pages it released or pins, and its
prefix lock are this record's, written only by the KV manager and its group managers. Others read
a sequence's page rows through ``KVManager.rows(seq)`` (the scheduler hands them to the model runner
in its ``SchedulerOutput``).

Page rows: ``pages[g]`` maps logical page ``i`` (positions [i*page, (i+1)*page)) to a page of KV
group ``g`` (``kv_groups``; group 0 is full attention, then the sliding-window groups); all rows
have one entry per logical page, and ``pages[g][i] == NOT_RESIDENT`` means that page's KV is not
resident in window group ``g`` (it left the window, or the prefix cache never had to keep it). The
first ``num_borrowed_pages`` entries of every row belong to the radix prefix cache (locked while the
sequence runs), the rest to the sequence. A full-attention model has one row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_core.caches.radix_node import PrefixLock

NOT_RESIDENT = -1  # a page-table entry for a page whose KV is not in the pool (left a window)


@dataclass(eq=False)
class SeqKV:
    """The KV a sequence holds (empty rows: none)."""

    pages: list[list[int]] = field(default_factory=list)  # one row per KV group
    num_borrowed_pages: int = 0  # leading entries of every row that are the prefix cache's
    # per group: leading logical pages already dropped from its window (NOT_RESIDENT unless
    # pinned; always 0 for full attention)
    num_released: list[int] = field(default_factory=list)
    # Positions whose windows every window group keeps until release (0: none): a branch point's
    # (heals it in the tree) and the prompt's last page boundary (a next turn resumes there).
    pin_end: int = 0
    prompt_pin: int = 0
    prefix_lock: PrefixLock | None = None  # held while the sequence uses a prefix-cache hit

    @property
    def num_pages(self) -> int:
        """Logical pages held (every group's row has this many entries)."""
        return len(self.pages[0]) if self.pages else 0

    @property
    def pin_ends(self) -> tuple[int, int]:
        return (self.pin_end, self.prompt_pin)
