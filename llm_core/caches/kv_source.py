"""KV of a sequence's positions [start, end) that arrive by copy instead of by compute.

Two sources fill a prompt's pages this way, through one mechanism:

- a prefill engine's hand-off (``kv_transfer.kv_import.KVImport``): the whole prompt, start 0,
  plus the token the prefill engine sampled after it;
- the host tier (``caches.host_restore.HostRestore``): pages evicted from the prefix cache, from the
  end of the cache's hit on.

The scheduler plans the copied range as prefill chunks (its pages come from the pools as usual, a
full pool preempts as usual), the model runner writes the chunk instead of running the model, and
what follows ``end`` is computed. With ``SchedulerConfig.kv_copy_overlap`` a chunk of a source
without ``first_token`` (a restore) may cross ``end``: the runner copies [c, end) layer by layer
(``write_layer``) beside the forward of [end, c + n) and of the step's other sequences, whose layer
i waits for layer i's copy (``serving/kv_copy.py``). An import's chunks stop at ``end``: its
``first_token`` is the token after them, nothing is computed. A sequence that is preempted
or aborted while copying never puts its pages in the prefix cache: SWA pages of positions below
the final window were allocated but never written (``KVManager.release``).
"""

from __future__ import annotations

from typing import Protocol

from llm_core.caches.kv_pool import PagedKVCache, PageRows


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

    def write(self, kv: PagedKVCache, rows: PageRows, lo: int, hi: int) -> None:
        """Write positions [lo, hi) (within [start, end)) into the sequence's pages (``rows``: its
        page row per KV group): ``write_layer`` for every layer in order."""
        ...

    def write_layer(self, kv: PagedKVCache, layer: int, rows: PageRows, lo: int, hi: int) -> None:
        """Write positions [lo, hi) of model layer ``layer`` only, through ``kv.layer_storage`` (never
        waits on ``kv.gate``: the copier is the one that opens it). Called once per layer of a chunk,
        in layer order; accounting per chunk (bytes, seconds) happens at the last layer."""
        ...
