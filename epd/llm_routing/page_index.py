"""What one engine's prefix cache holds, page by page, and how many prompt tokens it would hit.

Pages are named by their chained content hash (``epd_common.messages.page_hash``): the name of page i
covers every cache key of pages [0, i], so one name stands for a whole prefix and a lookup needs no
tree, only a walk over the request's own page names. The hit rule is the radix cache's, exactly:

    the longest page boundary b <= max_tokens such that
      full KV of every page of [0, b) is present, and
      SWA KV of the pages covering [b - (W-1), b) is live (all of [0, b) when shorter)

    page:  [  0   |  1   |  2   |  3   ]      W-1 = 2 pages
    full:  [  x   |  x   |  x   |  x   ]
    SWA:   [ live | tomb | live | live ]      hit = 4 pages (b = 1 page also qualifies; 2 and 3 do not)

Two indexes answer the same ``hit_tokens`` question:

- ``EnginePageIndex``: exact, rebuilt from the engine's KV events (stored, SWA tombstoned, removed,
  cleared). Mutated by a subscriber thread, read by the event loop: both go through one lock, and a
  whole batch is applied under it so a lookup never sees half a batch.
- ``ApproxPageIndex``: for an engine that publishes nothing; the router records the pages of each
  prompt it sends there (as full and live) and forgets them after a TTL, as Dynamo's router does
  without events. It can be wrong both ways (evicted early, or never cached); the TTL bounds how
  long a wrong guess steers traffic.

Neither knows anything of engines, URLs or load.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from epd_common.messages.hit_rule import window_accepts
from epd_common.messages.kv_events import (
    FULL_GROUP,
    SWA_GROUP,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    SwaTombstoned,
)

# Page state bits (an int per page keeps the dict small).
FULL = 1  # the page's full-attention KV is in the tree
SWA_LIVE = 2  # the page's sliding-window KV is in the tree (not a tombstone)
BOTH = FULL | SWA_LIVE


def longest_hit(
    hashes: Sequence[int],
    max_tokens: int,
    page_size: int,
    window_tokens: int,
    state_of: Callable[[int], int],
) -> int:
    """The radix cache's hit rule over page states (see the module docstring).

    ``window_tokens`` = W-1, the SWA keys a resumed query reads before its boundary (0: none).
    ``state_of(h)``: FULL / SWA_LIVE bits of page ``h`` (0: absent). O(pages walked).
    """
    best = 0
    run = 0  # tokens of consecutive SWA-live pages ending at the boundary
    for i in range(min(len(hashes), max_tokens // page_size)):
        state = state_of(hashes[i])
        if not state & FULL:
            break  # chained names: no later page of this request can be present
        run = run + page_size if state & SWA_LIVE else 0
        b = (i + 1) * page_size
        if window_accepts(run, b, window_tokens):  # the engine's own rule (epd_common.messages.hit_rule)
            best = b
    return best


class EnginePageIndex:
    """hash -> FULL / SWA_LIVE bits of one engine's prefix cache, kept from its KV events.

    Groups (``epd_common.messages.kv_events``): group 0 ("full_attention") stores full KV only, its SWA state is not
    live until a group-1 ("sliding_window") event says so; ``SwaTombstoned`` and a group-1
    ``BlockRemoved`` drop the SWA bit; a group-0 ``BlockRemoved`` drops the page. An event with no
    group or one this index does not know (a vLLM engine) counts as full and SWA-live: such an
    engine serves a model without SWA layers, whose window the router then takes as 1.
    """

    def __init__(self, page_size: int, sliding_window: int) -> None:
        if page_size < 1 or sliding_window < 1:
            raise ValueError(
                f"need page_size >= 1 and sliding_window >= 1, got {page_size}, {sliding_window}"
            )
        self.page_size = page_size
        self.sliding_window = sliding_window
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
                    bits = _stored_bits(event)
                    for h in event.block_hashes:
                        pages[h] = pages.get(h, 0) | bits
                elif isinstance(event, SwaTombstoned):
                    self._drop_swa(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    if event.group_idx == SWA_GROUP:
                        self._drop_swa(event.block_hashes)
                    else:
                        for h in event.block_hashes:
                            pages.pop(h, None)
                elif isinstance(event, AllBlocksCleared):
                    pages.clear()

    def _drop_swa(self, hashes: Sequence[int]) -> None:
        pages = self._pages
        for h in hashes:
            state = pages.get(h, 0) & ~SWA_LIVE
            if state:
                pages[h] = state
            else:
                pages.pop(h, None)  # a page that was SWA-only (events out of order) is gone

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()

    def hit_tokens(self, hashes: Sequence[int], max_tokens: int) -> int:
        """Prompt tokens the engine would find cached: pass ``num_prompt_tokens - 1`` as
        ``max_tokens`` (the engine always computes the last prompt token)."""
        with self._lock:
            return longest_hit(hashes, max_tokens, self.page_size, self.sliding_window - 1, self._state)

    def _state(self, h: int) -> int:
        return self._pages.get(h, 0)


def _stored_bits(event: BlockStored) -> int:
    if event.group_idx == SWA_GROUP or event.kv_cache_spec_kind == "sliding_window":
        return SWA_LIVE
    if event.group_idx == FULL_GROUP:
        return FULL
    return BOTH  # no group, or one we do not know: a model without SWA layers


class ApproxPageIndex:
    """The pages of prompts the router sent to one engine, each kept ``ttl_s`` after its last send.

    Every recorded page counts as full and SWA-live: without events there is no way to know
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
        """Same contract as ``EnginePageIndex.hit_tokens``; no SWA window applies (all live)."""
        with self._lock:
            self._now = self._clock()
            self._expire(self._now)
            return longest_hit(hashes, max_tokens, self.page_size, 0, self._state)

    def _state(self, h: int) -> int:
        until = self._expiry.get(h)
        return BOTH if until is not None and until > self._now else 0

    def _expire(self, now: float) -> None:
        expiry = self._expiry
        while expiry:
            h, until = next(iter(expiry.items()))
            if until > now:
                return
            del expiry[h]
