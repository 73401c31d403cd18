"""What one engine's prefix cache holds, page by page, and how many prompt tokens it would hit.

Pages are named by their chained content hash (``epd_common.messages.page_hash``): the name of page i
covers every cache key of pages [0, i], so one name stands for a whole prefix and a lookup needs no
tree, only a walk over the request's own page names. The hit rule is the radix cache's, exactly:

    the longest page boundary b <= max_tokens such that
      group 0's (full attention) KV of every page of [0, b) is present, and
      for each window group g (window W_g), its KV of the pages covering [b - (W_g-1), b) is live
      (all of [0, b) when shorter)

    page:      [  0   |  1   |  2   |  3   ]      W-1 = 2 pages
    group 0:   [  x   |  x   |  x   |  x   ]
    window g:  [ live | tomb | live | live ]      hit = 4 pages (b = 1 page also qualifies; 2 and 3 do not)

Two indexes answer the same ``hit_tokens`` question:

- ``EnginePageIndex``: exact, rebuilt from the engine's KV events (stored, removed per group,
  cleared). Mutated by a subscriber thread, read by the event loop: both go through one lock, and a
  whole batch is applied under it so a lookup never sees half a batch.
- ``ApproxPageIndex``: for an engine that publishes nothing; the router records the pages of each
  prompt it sends there (as present in every group) and forgets them after a TTL, as Dynamo's
  router does without events. It can be wrong both ways (evicted early, or never cached); the TTL
  bounds how long a wrong guess steers traffic.

Neither knows anything of engines, URLs or load.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from epd_common.messages.hit_rule import groups_accept
from epd_common.messages.kv_events import (
    FULL_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

# A page's state is an int: bit g set while KV group g's KV of the page is cached (bit 0: group 0,
# full attention, whose pages name the prefix).
PRESENT = 1 << FULL_GROUP


def longest_hit(
    hashes: Sequence[int],
    max_tokens: int,
    page_size: int,
    windows: Sequence[tuple[int, int]],
    state_of: Callable[[int], int],
) -> int:
    """The radix cache's hit rule over page states (see the module docstring).

    ``windows``: per window group, (its bit, W-1: the keys a resumed query reads before its
    boundary). ``state_of(h)``: the group bits of page ``h`` (0: absent). O(pages walked).
    """
    n = min(len(hashes), max_tokens // page_size)
    if not windows:  # every boundary of present pages is a hit: the last one is (no list per page)
        i = 0
        while i < n and state_of(hashes[i]) & PRESENT:
            i += 1
        return i * page_size
    best = 0
    need = [w for _, w in windows]
    runs = [0] * len(windows)  # per window group: tokens of consecutive live pages ending at b
    for i in range(n):
        state = state_of(hashes[i])
        if not state & PRESENT:
            break  # chained names: no later page of this request can be present
        runs = [r + page_size if state & bit else 0 for r, (bit, _) in zip(runs, windows, strict=True)]
        b = (i + 1) * page_size
        if groups_accept(runs, b, need):  # the engine's own rule (epd_common.messages.hit_rule)
            best = b
    return best


class EnginePageIndex:
    """hash -> group bits of one engine's prefix cache, kept from its KV events.

    ``windows[g]``: KV group g's window (keys per query, the query included; None: full
    attention), as the engine's /health lists its groups (``kv_groups``); group 0 is full
    attention. A ``BlockStored`` of group g sets bit g; a ``BlockRemoved`` of a window group clears
    its bit (the page's full KV stays), of group 0 drops the page. An event with no group or one
    this index does not know (a vLLM engine serving a model without windows) counts for every
    group.
    """

    def __init__(self, page_size: int, windows: Sequence[int | None] = (None,)) -> None:
        windows = tuple(windows) or (None,)
        if page_size < 1 or windows[0] is not None or any(w is not None and w < 1 for w in windows):
            raise ValueError(
                f"need page_size >= 1, group 0 full attention and windows >= 1, got {page_size}, {windows}"
            )
        self.page_size = page_size
        self.windows = windows
        self._all = (1 << len(windows)) - 1
        self._needs = tuple((1 << g, w - 1) for g, w in enumerate(windows) if w is not None)
        self._pages: dict[int, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._pages)

    def apply(self, batch: KVEventBatch) -> None:
        """Apply one batch of events, in order, atomically with respect to ``hit_tokens``."""
        with self._lock:
            pages = self._pages
            for event in batch.events:
                if isinstance(event, BlockStored):
                    bits = self._bits(event.group_idx)
                    for h in event.block_hashes:
                        pages[h] = pages.get(h, 0) | bits
                elif isinstance(event, BlockRemoved):
                    g = event.group_idx
                    if g is not None and g != FULL_GROUP and g < len(self.windows):
                        self._drop_group(event.block_hashes, 1 << g)
                    else:
                        for h in event.block_hashes:
                            pages.pop(h, None)
                elif isinstance(event, AllBlocksCleared):
                    pages.clear()

    def _bits(self, group: int | None) -> int:
        if group is None or group >= len(self.windows):
            return self._all  # no group, or one we do not know: a model without window groups
        return 1 << group

    def _drop_group(self, hashes: Sequence[int], bit: int) -> None:
        pages = self._pages
        for h in hashes:
            state = pages.get(h, 0) & ~bit
            if state:
                pages[h] = state
            else:
                pages.pop(h, None)  # a page that only that group held (events out of order) is gone

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()

    def hit_tokens(self, hashes: Sequence[int], max_tokens: int) -> int:
        """Prompt tokens the engine would find cached: pass ``num_prompt_tokens - 1`` as
        ``max_tokens`` (the engine always computes the last prompt token)."""
        with self._lock:
            return longest_hit(hashes, max_tokens, self.page_size, self._needs, self._state)

    def _state(self, h: int) -> int:
        return self._pages.get(h, 0)


class ApproxPageIndex:
    """The pages of prompts the router sent to one engine, each kept ``ttl_s`` after its last send.

    Every recorded page counts as present in every group: without events there is no way to know
    better. Memory is bounded by the traffic of one TTL: entries are kept in refresh order, so the
    expired ones are always at the front and each is dropped once.
    """

    def __init__(
        self, page_size: int, ttl_s: float = 120.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if page_size < 1 or ttl_s <= 0:
            raise ValueError(f"need page_size >= 1 and ttl_s > 0, got {page_size}, {ttl_s}")
        self.page_size = page_size
        self.ttl_s = ttl_s
        self._clock = clock
        self._expiry: OrderedDict[int, float] = OrderedDict()
        self._lock = threading.Lock()
        self._now = 0.0  # the clock at the current lookup (read once per lookup)

    def __len__(self) -> int:
        return len(self._expiry)

    def record(self, hashes: Sequence[int]) -> None:
        """The router sent a prompt with these pages here: (re)start their TTL."""
        with self._lock:
            until = self._clock() + self.ttl_s
            for h in hashes:
                self._expiry[h] = until
                self._expiry.move_to_end(h)
            self._expire(until - self.ttl_s)

    def clear(self) -> None:
        with self._lock:
            self._expiry.clear()

    def hit_tokens(self, hashes: Sequence[int], max_tokens: int) -> int:
        """Same contract as ``EnginePageIndex.hit_tokens``; no window rule applies (all live)."""
        with self._lock:
            self._now = self._clock()
            self._expire(self._now)
            return longest_hit(hashes, max_tokens, self.page_size, (), self._state)

    def _state(self, h: int) -> int:
        until = self._expiry.get(h)
        return PRESENT if until is not None and until > self._now else 0

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry:
            h, until = next(iter(expiry.items()))
            if until > now:
                return
            del expiry[h]
