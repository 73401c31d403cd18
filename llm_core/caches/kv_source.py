"""KV of a sequence's positions [start, end) that arrive by copy instead of by compute.

Two sources fill a prompt's pages this way, through one mechanism:

- a prefill engine's hand-off (``kv_transfer.kv_import.KVImport``): the whole prompt, start 0,
  plus the token the prefill engine sampled after it;
- the host tier (``caches.host_tier.HostRestore``): pages evicted from the prefix cache, from the
  end of the cache's hit on.

The scheduler plans the copied range as prefill chunks (its pages come from the pools as usual, a
full pool preempts as usual; a chunk never crosses ``end``), the model runner writes the chunk
instead of running the model, and what follows ``end`` is computed. A sequence that is preempted
or aborted while copying never puts its pages in the prefix cache: SWA pages of positions below
the final window were allocated but never written (``KVManager.release``).
"""

from __future__ import annotations

from typing import Protocol

from llm_core.caches.kv_pool import DualKVCache


class KVSource(Protocol):
    @property
    def start(self) -> int:
        """The first position copied (the positions before are the prefix cache's)."""
        ...

    @property
    def end(self) -> int:
        """One past the last position copied."""
        ...

    @property
    def first_token(self) -> int | None:
        """The token after the prompt when the source covers all of it (None: sample it)."""
        ...

    def write(self, kv: DualKVCache, full_pages: list[int], swa_pages: list[int], lo: int, hi: int) -> None:
        """Write positions [lo, hi) (within [start, end)) into the sequence's pages."""
        ...
